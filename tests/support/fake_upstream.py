"""Re-export of `bench.support.fake_upstream` (the code lives there, installed with the benchmarks)."""

from bench.support.fake_upstream import ANSWER_WORDS, FakeUpstream, Recorded

__all__ = ["ANSWER_WORDS", "FakeUpstream", "Recorded"]
