"""local_runner: the embedded engine, the served models run in the proxy's own process (docs/engine.md).

    engine.py         EmbeddedEngine: engine_api's Engine; owns the steps, pools, stores, scheduler and
                      the worker thread, which calls step(): schedule -> run -> postprocess
    config.py         EngineConfig, derived from the settings (proxy/local/config.py)
    scheduler.py      who waits, who runs, what each step feeds (admission.py: fair per client)
    jobs.py           Job: a submitted turn, and the outbox its events reach the event loop through
    job_state.py      JobState: one admitted job between steps (restore, prefill, decode, save)
    store_hints.py    what the stores learn from the queue (schedule, prefetch)
    step_run.py       a step's forwards, with the recovery that ends only the failing job
    memory_guard.py   memory pressure at admission and in a step
    save_handoff.py   the thread that saves ended jobs' KV and frees their slots
    model_step.py     how one model computes a step (packed or per job, compiled or eager, exact)
    loader.py         a model loaded and prepared (engine_api.model_source finds its weights)
    the rest          the step's parts: KV slots, packed attention, the exact kernels, the decoder loop,
                      sampling (with grammars), text streaming, RoPE shifts

Imports point one way: this package imports engine_api and kvtier, never the proxy nor vllm_engine.
"""
