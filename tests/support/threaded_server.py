"""Re-export of `bench.support.threaded_server` (the code lives there, installed with the benchmarks)."""

from bench.support.threaded_server import AppServer, AppSource, free_port, serve_in_thread

__all__ = ["AppServer", "AppSource", "free_port", "serve_in_thread"]
