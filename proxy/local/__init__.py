"""Local serving on the embedded engine (`local_runner.engine: "embedded"`), the proxy's side of it: from
settings to the engine (`local_runner/`) and the serving layer above it.

    config.py  settings.json -> the engine's `EngineConfig` (torch-free)
    build.py   the models loaded, one KV store each, the engine started, the serving layer over it

Imported only when `local_runner.enabled` (build.py pulls in torch and transformers)."""
