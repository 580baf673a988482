"""Local serving on vLLM (`local_runner.engine: "vllm"`): the second `proxy.backend.LocalBackend`.

    settings_check.py  which settings the vLLM engine honours (torch-free; settings.py calls it)
    launch.py          the vLLM server command for one model, from settings
    engine.py          starting, waiting for and stopping that server (a process group)
    stream.py          vLLM's completion stream, read as text deltas, the finish and the usage
    answer.py          those events as the client's Chat Completions answer (streamed or not)
    backend.py         the LocalBackend: render, admit, forward to vLLM, headers from the store's report
    build.py           everything above from settings

Each local model gets its own vLLM OpenAI server on loopback, loaded with kvtier's AttnStoreConnector
(kvtier/vllm_connector.py), whose store answers on a UNIX socket the backend reads each turn's reuse
from. Only settings_check is imported by the proxy's core; the rest loads when the engine is chosen.
"""
