"""Re-export of `bench.support.processes` (the code lives there, installed with the benchmarks)."""

from bench.support.processes import HAPROXY, HAPROXY_CFG, REPO, UNREACHABLE, HAProxy, ReplicaProcess

__all__ = ["HAPROXY", "HAPROXY_CFG", "REPO", "UNREACHABLE", "HAProxy", "ReplicaProcess"]
