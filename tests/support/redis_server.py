"""Re-export of `bench.support.redis_server` (the code lives there, installed with the benchmarks)."""

from bench.support.redis_server import REDIS_SERVER, RedisServer

__all__ = ["REDIS_SERVER", "RedisServer"]
