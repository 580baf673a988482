"""The compiled packed step (local_runner.compile, issue 17; the rounding-dependent path kept selectable
beside the exact default) with the real model in float32, cut to its first layers so that it compiles in
seconds rather than a minute: its greedy answers equal transformers' `generate`, alone and four at once,
and a second turn from stored KV equals a recompute; where it cannot compile it runs eagerly and says
why."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from torch import nn

from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, GenerationRequest
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from local_runner.loader import load_model
from proxy.local.config import engine_config
from proxy.settings import DEFAULT_MODEL_SOURCE
from tests.model_fixture import MODEL, REPO
from tests.rendering import render
from tests.support.waiting import wait_until
from tests.test_local_runner_batching import drain
from tests.tiny_model import tiny_llama, tiny_loaded

QUESTIONS = [
    "Name three rivers in Europe.",
    "What is the capital of Japan?",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
]
TOKENS = 12
LAYERS = 8  # of SmolLM2's 30: the compile's time grows with the layers, the code it runs does not change


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A engine compiling a model of its own (the session's shared model is packed for eager steps,
    which a compiled step cannot take), with a store, once its compile is done."""
    full = load_model(
        MODEL, DEFAULT_MODEL_SOURCE, device="cpu", dtype="float32", cache_dir=REPO / "var" / "models"
    )
    full.model.model.layers = nn.ModuleList(full.model.model.layers[:LAYERS])
    full.model.config.num_hidden_layers = LAYERS
    if getattr(full.model.config, "layer_types", None):  # transformers' per-layer attention kinds
        full.model.config.layer_types = full.model.config.layer_types[:LAYERS]
    lm = dataclasses.replace(
        full,
        layout=dataclasses.replace(full.layout, num_layers=LAYERS),
        fingerprint=f"{full.fingerprint}-{LAYERS}-layers",
    )
    l2 = tmp_path_factory.mktemp("l2")
    store = KVStore(
        StoreConfig(
            l0_capacity_bytes=64 << 20, l1_capacity_bytes=64 << 20, l2_capacity_bytes=1 << 30, l2_path=l2
        ),
        lm.layout,
        lm.fingerprint,
    )
    engine = EmbeddedEngine(
        {MODEL: lm},
        {MODEL: store},
        config=engine_config(max_running=4, max_queue=8, compile=True, batch_invariant=False),
    ).start()
    wait_until(lambda: not engine.steps[MODEL].compiling, "the compile", 600, interval=0.5)
    yield engine
    engine.close()


def generate(engine: EmbeddedEngine, ids: list[int]) -> list[int]:
    """transformers' own greedy decoding of the same model (the reference)."""
    model = engine.models[MODEL].model
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


def submit(engine: EmbeddedEngine, ids: list[int], **kw):
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0)
    return engine.submit(GenerationRequest(MODEL, ids, sampling, **kw))


@pytest.mark.model
async def test_compiled_answers_equal_generate_alone_and_four_at_once(compiled):
    status = compiled.steps[MODEL].describe()["compiled"]
    assert str(status).startswith("compiled in"), status  # not a silent fallback to the eager step
    prompts = [render(compiled, MODEL, [{"role": "user", "content": q}]).ids for q in QUESTIONS]
    alone = [await drain(submit(compiled, p, reuse=False)) for p in prompts]
    together = await asyncio.gather(*(drain(submit(compiled, p, reuse=False)) for p in prompts))
    tokenizer = compiled.models[MODEL].tokenizer
    for prompt, one, four in zip(prompts, alone, together, strict=True):
        expected = tokenizer.decode(generate(compiled, prompt), skip_special_tokens=True)
        assert one.text == expected
        assert four.text == expected


@pytest.mark.model
async def test_compiled_second_turn_from_stored_kv_equals_a_recompute(compiled):
    history = [{"role": "user", "content": "Tell me about the moon."}]
    first = await drain(submit(compiled, render(compiled, MODEL, history).ids, session="moon"))
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the sun?"}]
    ids = render(compiled, MODEL, history).ids
    await asyncio.sleep(0.5)  # the first turn's KV is saved asynchronously
    reused = await drain(submit(compiled, ids, session="moon"))
    recomputed = await drain(submit(compiled, ids, reuse=False))
    assert reused.first is not None and reused.first.reused_tokens > 0
    assert reused.text == recomputed.text


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"batch_invariant": True}, "batch_invariant runs eagerly"),
        ({"batch": False}, "only decoder.py's forward"),
    ],
)
async def test_a_step_that_cannot_compile_runs_eagerly_saying_why(options, reason):
    lm = tiny_loaded("tiny", model=tiny_llama(seed=3))
    engine = EmbeddedEngine(
        {"tiny": lm}, config=engine_config(**{"compile": True, "batch_invariant": False, **options})
    ).start()
    try:
        status = str(engine.steps["tiny"].describe()["compiled"])
        assert status.startswith("eager (") and reason in status
        job = engine.submit(
            GenerationRequest("tiny", [5, 9, 13], SamplingParams(max_tokens=4, temperature=0))
        )
        assert isinstance((await drain(job)).end, Finished)  # it answers, eagerly
        assert engine.steps["tiny"].lm.dense is not None  # the eager dense path was prepared
    finally:
        engine.close()


async def test_a_model_packed_by_an_eager_runner_is_not_compiled_by_a_later_one():
    lm = tiny_loaded("tiny", model=tiny_llama(seed=3))
    EmbeddedEngine(
        {"tiny": lm}, config=engine_config()
    ).start().close()  # packs the linear layers for its eager step
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(compile=True, batch_invariant=False)).start()
    try:
        status = str(engine.steps["tiny"].describe()["compiled"])
        assert "already packed" in status
    finally:
        engine.close()


async def test_jobs_are_served_eagerly_while_the_step_compiles():
    """A engine answers at once after start: its first jobs run on the eager step while the compile
    runs on its own thread, and the step switches to the compiled one when that is ready."""
    lm = tiny_loaded("tiny", model=tiny_llama(seed=6))
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(compile=True, batch_invariant=False)).start()
    try:
        step = engine.steps["tiny"]
        job = engine.submit(
            GenerationRequest("tiny", [5, 9, 13], SamplingParams(max_tokens=4, temperature=0))
        )
        first = await drain(job)
        assert isinstance(first.end, Finished) and step.compiling  # answered before the compile was done
        wait_until(lambda: not step.compiling, "the compile", 600, interval=0.2)
        assert str(step.describe()["compiled"]).startswith("compiled in"), step.describe()
        again = await drain(
            engine.submit(GenerationRequest("tiny", [5, 9, 13], SamplingParams(max_tokens=4, temperature=0)))
        )
        assert again.text == first.text  # float32: the compiled step answers as the eager one did
    finally:
        engine.close()


async def test_the_warm_up_is_reported_done_or_failed_and_a_failed_one_still_serves():
    """/healthz's `warm_up`: pending until the worker has warmed the step up, then "done in N s"; a
    warm-up that raised says why, and the engine serves all the same (only the first job pays)."""
    lm = tiny_loaded("tiny", model=tiny_llama(seed=3))
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config())
    step = engine.steps["tiny"]
    assert step.describe()["warm_up"] == "pending"
    engine.start()
    try:
        wait_until(lambda: str(step.describe()["warm_up"]).startswith("done in "), "the warm-up")
    finally:
        engine.close()
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config())

    def broken(run) -> None:
        raise RuntimeError("no compiler for the kernels")

    engine.steps["tiny"].warm_up = broken
    engine.start()
    try:
        status = lambda: str(engine.steps["tiny"].describe()["warm_up"])  # noqa: E731
        wait_until(lambda: status() != "pending", "the warm-up's end")
        assert status() == "failed: no compiler for the kernels"
        job = engine.submit(
            GenerationRequest("tiny", [5, 9, 13], SamplingParams(max_tokens=4, temperature=0))
        )
        assert isinstance((await drain(job)).end, Finished)
    finally:
        engine.close()
