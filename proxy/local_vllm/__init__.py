"""Local serving on vLLM (`local_runner.engine: "vllm"`): the second engine under the serving layer.

    settings_check.py  which settings the vLLM engine honours (torch-free; settings.py calls it)
    launch.py          the vLLM server command for one model, from settings
    engine.py          starting, waiting for and stopping that server (a process group)
    stream.py          vLLM's completion stream, read as text deltas, the finish and the usage
    turns.py           the engine (proxy.serving.engine.Engine): a turn's ids to vLLM, its stream back
                       as the serving layer's events, what it reused from the store's report
    build.py           everything above from settings

Each local model gets its own vLLM OpenAI server on loopback, loaded with kvtier's AttnStoreConnector
(kvtier/vllm_connector.py), whose store answers on a UNIX socket the engine reads each turn's reuse
from. Only settings_check is imported by the proxy's core; the rest loads when the engine is chosen.
"""
