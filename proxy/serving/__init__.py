"""The serving layer: one implementation of local serving above both engines (see service.py), calling
them through the engine interface (`engine_api.engine.Engine`, with its turn, events and errors).

    options.py         which options of each API are served locally; validated sampling values
    prompts.py         prompts -> token ids (chat template + truncation, or a completion's prompt)
    choices.py         n > 1: the n answers of one turn as one stream
    answers.py         the events as the client's answer: Chat Completions, Completions, Responses
    tools.py           tool calls: the forced-call grammar, and the model's calls parsed from its text
    structured.py      response_format's JSON grammar
    response_store.py  the Responses API's stored responses (in the session index)
    service.py         LocalServing: the proxy's LocalBackend, a turn from request to recorded session

Importing this package pulls in nothing heavy (engine_api is torch-free); it is imported only when local
serving is on.
"""
