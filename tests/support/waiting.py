"""Re-export of `bench.support.waiting` (the code lives there, installed with the benchmarks)."""

from bench.support.waiting import async_wait_until, wait_until

__all__ = ["async_wait_until", "wait_until"]
