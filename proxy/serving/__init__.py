"""The serving layer: one implementation of local serving above both engines (see service.py).

    engine.py          the seam below: what an engine does for a turn (Engine, its events)
    options.py         which options of each API are served locally; validated sampling values
    prompts.py         prompts -> token ids (chat template + truncation, or a completion's prompt)
    answers.py         the events as the client's answer: Chat Completions, Completions, Responses
    response_store.py  the Responses API's stored responses (in the session index)
    service.py         LocalServing: the proxy's LocalBackend, a turn from request to recorded session

Importing this package pulls in nothing heavy; engine.py, service.py and answers.py import
`local_runner.jobs` (plain data) and are imported only when local serving is on.
"""
