"""Local serving on the vLLM engine (`local_runner.engine: "vllm"`), the proxy's side of it: from settings
to the engine (`vllm_engine/`, beside `local_runner/`) and the serving layer above it.

    config.py          settings.json -> the engine's `VllmConfig` (torch-free)
    build.py           the engine's servers started from that config, the serving layer over its
                       `VllmEngine`

The values the vLLM engine refuses are checked with the settings (proxy/settings_vllm.py); this package
loads when the engine is chosen.
"""
