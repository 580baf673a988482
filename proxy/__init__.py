"""The proxy: the OpenAI-compatible HTTP surface, routing each turn locally (the serving layer over an
engine) or upstream, and the replicas together.

Its parts stand in layers, each importing only those below it (tests/test_proxy_units.py holds it):

    cli.py, __main__.py      `attnstore serve` / `bench`
    http/                    the roof: the aiohttp app, its middleware and routes
    local/, local_vllm/      from settings to an engine and the serving layer over it (torch: loaded
                             only when local serving is on)
    serving/                 LocalServing: a local turn from request to recorded session, for both engines
    cluster/                 the session index and forwarding between replicas
    upstream/                every call to llm_endpoint, and the header filter
    turns/                   one turn: tenant, session, route, its outcome (headers, log line, metrics)
    openai/                  the API's request parsing and answer shapes
    settings.py, settings_vllm.py, errors.py, metrics.py   the ground: the settings schema, error objects,
                             Prometheus metrics

The app's only state is its typed keys, each defined beside what it holds (`settings.SETTINGS`,
`metrics.METRICS`, `upstream.forward.HTTP_CLIENT`, `turns.local_start.LOCAL_START`,
`cluster.session_index.SESSION_INDEX`, `cluster.forwarding.FORWARDER`).
"""
