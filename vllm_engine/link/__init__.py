"""The parts of attnstore's vLLM connector (vllm_engine/connector.py is the class vLLM loads):

    plan.py     the arithmetic: request parameters, tokens to restore, block slots, tiers  (no torch)
    options.py  the connector's settings and the model fingerprint                          (no torch)
    wire.py     the store's socket: server and clients                                       (no torch)
    pages.py    where K and V sit in vLLM's paged cache (a page map), moved in and out by token slot
    discover.py the page map of a backend, found at start through its own write kernel and checked
    service.py  the store's answers on its socket (in vLLM's worker process)
    worker.py   restoring into and saving out of vLLM's blocks, layer by layer
    scheduler.py  matching, prefetch, the queue as a hint, what each step loads and saves
    setup.py    the worker side's start from vLLM's caches

Nothing here imports vLLM (setup.py only checks its version), and of attnstore only kvtier: this runs in
vLLM's processes. The torch-free modules are what the engine (engine.py, server.py) talks to the store with.
"""
