"""Local serving on the embedded engine (`local_runner.engine: "embedded"`), the proxy's side of it: from
settings to the engine (`local_runner/`) and the serving layer above it (build.py).

Imported only when `local_runner.enabled` (it pulls in torch and transformers)."""
