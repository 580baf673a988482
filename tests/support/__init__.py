"""Test support shared with the benchmarks: the threaded app server, the fake upstream, a Redis server.

None of it is product code: `proxy/`, `kvtier/` and `local_runner/` never import it."""
