"""Local serving on the vLLM engine (`local_runner.engine: "vllm"`), the proxy's side of it: from settings
to the engine (`vllm_engine/`, beside `local_runner/`) and the serving layer above it.

    settings_check.py  the values the vLLM engine refuses (torch-free; settings.py calls it)
    config.py          settings.json -> the engine's `VllmConfig` (torch-free)
    build.py           the engine's servers started from that config, the serving layer over its
                       `VllmEngine`

Only settings_check is imported by the proxy's core; the rest loads when the engine is chosen.
"""
