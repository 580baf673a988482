"""engine_api: what an engine is to the serving layer, torch-free, shared by both engines and the proxy.

    engine.py        Engine: the interface the serving layer calls (a turn run as events, stats, forgetting)
    turn.py          GenerationRequest and the events a turn yields (FirstToken, TextDelta, Finished, Failed)
    sampling.py      SamplingParams and TokenLogprob: plain data, validated by the proxy, read by engines
    errors.py        what a turn's first step may raise instead (QueueFull, OverShare, EngineError) and the
                     hit rule both engines admit by (counts_as_hit)
    stats.py         EngineStats: an engine's queue and stores, for /v1/attention_store/stats and /metrics
    prompt.py        chat messages -> prompt token ids through the model's chat template, with truncation
    model_source.py  a served model's source (an HF folder, a .gguf, pkg:NAME) -> the folder its weights
                     load from (a GGUF converted once), and the dtype `auto` picks
    tokenizers.py    ThreadTokenizers: one copy of a tokenizer per thread

Imports point one way: the proxy and the engines (`local_runner`, `vllm_engine`) import this package; it
imports neither, and only kvtier's torch-free modules. Importing it loads neither torch nor transformers
(prompt.py and model_source.py import them where they are called).
"""
