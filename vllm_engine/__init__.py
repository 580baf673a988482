"""vllm_engine: vLLM as attnstore's second engine, beside the embedded `local_runner`, a client of kvtier's
`KVStore` as the embedded engine is.

    engine.py      VllmEngine: a turn's token ids to the model's vLLM server, its stream back as the
                   events of `engine_api.turn`, what it reused from the store's report
    start.py       every model's server started from a `VllmConfig` (a GGUF converted once), and waited for
    launch.py      VllmConfig, and the vLLM server command for one model from it
    server.py      one vLLM server as a child process group: started, waited for, stopped
    stream.py      vLLM's completion stream, read as text deltas, the finish and the usage
    store_view.py  the store's stats and forgetting a session, through its socket
    connector.py   AttnStoreConnector, the class vLLM loads (kv_connector_module_path
                   "vllm_engine.connector"): the store under vLLM's own KV memory
    link/          the connector's parts: the arithmetic, the store's socket, vLLM's paged layout,
                   the worker and scheduler sides

Imports point one way: the proxy imports this package; this package imports `engine_api` (the interface
it implements: the turn, its events and errors, the tokenizer and model-source helpers) and `kvtier`,
never the proxy nor the embedded engine. The connector and link/ import only kvtier (they run inside
vLLM's processes). Importing this package loads nothing; launch.py and link's plan, options and wire
are torch-free.
"""
