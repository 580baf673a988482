"""The vLLM engine's settings: what is refused at start (a value that would do nothing), and what the
accepted ones become on vLLM's command line and in the connector's options; vLLM's stream as events."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest

from engine_api.model_source import ModelLoadError
from proxy.local_vllm.config import vllm_config
from proxy.settings import EmbeddedRunnerSettings, Settings, SettingsError, parse_settings
from vllm_engine.launch import kv_bytes_per_token, vllm_dtype, vllm_launch
from vllm_engine.stream import Delta, Finish, StreamError, TokenUsage, parse_event

VLLM = {"engine": "vllm", "vllm_args": ["-O0"]}
# What the vLLM engine does not implement is set to false (their defaults are true).
NO_DECOUPLE = {"position_encoding": {"decouple": False}, "scheduler_aware": {"evict_on_pressure": False}}


def settings(tmp_path: Path, **sections: Any) -> Settings:
    store = {"tiering": {"l2_disk": {"path": str(tmp_path / "kv")}}}
    if sections.get("local_runner", {}).get("engine") == "vllm":
        store.update(NO_DECOUPLE)
    raw = {"attention_store": store, **sections}
    return parse_settings(orjson.dumps(raw), tmp_path, env={})


@pytest.mark.parametrize(
    ("sections", "refusal"),
    [
        (
            {"local_runner": {"vllm_args": ["-O0"]}},
            "local_runner.vllm_args: only used with local_runner.engine 'vllm'",
        ),
        ({"local_runner": {"vllm_python": "/x"}}, "local_runner.vllm_python: only used"),
        (
            {"local_runner": {**VLLM, "threads": 2}},
            "local_runner.threads: has no effect with local_runner.engine 'vllm'",
        ),
        (
            {"local_runner": {**VLLM, "min_free_memory_mb": 5}},
            "local_runner.min_free_memory_mb: has no effect",
        ),
        ({"local_runner": {**VLLM, "device": "cpu"}}, "local_runner.device: the vLLM install decides"),
        (
            {"local_runner": {**VLLM, "vllm_args": ["--port=9"]}},
            "local_runner.vllm_args: --port is set by the proxy",
        ),
        (
            {"local_runner": {**VLLM, "vllm_args": ["--dtype", "half"]}},
            "--dtype is set by the proxy from local_runner.dtype",
        ),
        (
            {"local_runner": {**VLLM, "vllm_python": "/no/such/python"}},
            "local_runner.vllm_python: '/no/such/python' is not",
        ),
        (
            {"local_runner": VLLM, "attention_store": {"position_encoding": {"decouple": True}}},
            "decouple: not implemented",
        ),
        (
            {
                "local_runner": VLLM,
                "attention_store": {**NO_DECOUPLE, "tiering": {"l0_gpu": {"eviction": "lfu"}}},
            },
            "l0_gpu.eviction: vLLM evicts its own KV memory",
        ),
        ({"local_runner": {"engine": "sglang"}}, "local_runner.engine"),
        ({"local_runner": {"compile": True}}, "local_runner.compile: true needs batch_invariant: false"),
    ],
)
def test_a_key_the_engine_would_ignore_stops_start_up_naming_it(tmp_path, sections, refusal):
    with pytest.raises(SettingsError, match=refusal.replace(".", r"\.").replace("(", r"\(")):
        settings(tmp_path, **sections)


@pytest.mark.parametrize("named", [{}, {"engine": "embedded"}, {"engine": "transformers", "threads": 2}])
def test_the_embedded_engine_is_the_default_and_answers_to_its_earlier_name_too(tmp_path, named):
    runner = settings(tmp_path, local_runner=named).local_runner
    assert isinstance(runner, EmbeddedRunnerSettings) and runner.engine == "embedded"
    assert runner.threads == named.get("threads", 0)


@pytest.mark.parametrize("runner", [{}, VLLM])
def test_settings_written_back_with_every_key_read_the_same(tmp_path, runner):
    """The benchmarks write parsed settings back (every key, defaults included): still accepted."""
    first = settings(tmp_path, local_runner=runner)
    again = parse_settings(msgspec.json.encode(first), tmp_path, env={})
    assert again == first


def test_the_settings_become_vllms_arguments_and_the_connectors_options(tmp_path):
    s = settings(
        tmp_path,
        local_runner={
            **VLLM,
            "vllm_python": sys.executable,
            "max_running": 6,
            "max_batch_tokens": 1024,
            "kv_chunk_tokens": 512,
        },
        attention_store={
            "tiering": {
                "l0_gpu": {"capacity_mb": 256},
                "l1_host": {"capacity_mb": 64},
                "l2_disk": {"path": "kv"},
            },
            "preload": {"lookahead_turns": 3, "overlap_with_compute": False},
            **NO_DECOUPLE,
        },
    )
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    launch = vllm_launch(vllm_config(s, tmp_path), "m", folder, 8123, "/tmp/x.sock")
    argv = launch.argv
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

    def arg(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (arg("--model"), arg("--served-model-name"), arg("--port")) == (str(folder), "m", "8123")
    assert (arg("--max-num-seqs"), arg("--max-num-batched-tokens")) == ("6", "1024")
    assert arg("--kv-cache-memory-bytes") == str(256 << 20)
    assert arg("--max-model-len") == "2048"  # the model's own context is below max_context_tokens
    assert argv[-1] == "-O0"
    transfer = json.loads(arg("--kv-transfer-config"))
    assert transfer["kv_connector_module_path"] == "vllm_engine.connector"
    assert transfer["kv_load_failure_policy"] == "recompute"
    extra = transfer["kv_connector_extra_config"]
    assert extra["l1_capacity_bytes"] == 64 << 20 and extra["l2_path"] == str(tmp_path / "kv")
    assert extra["chunk_tokens"] == 512 and extra["lookahead"] == 3 and extra["layerwise"] is False
    assert extra["socket_path"] == "/tmp/x.sock" == launch.socket_path
    assert str(Path(__file__).resolve().parents[1]) in launch.env["PYTHONPATH"].split(":")


def test_a_kv_memory_short_of_one_whole_context_stops_start_up_naming_the_settings(tmp_path):
    """Two models share l0_gpu's 256 MB: each gets 128 MB, where one turn of a 2,048-token context of
    this shape (32 layers, 8 KV heads of 128, bfloat16: 128 KiB a token) needs 256 MB. Start-up stops
    before vLLM starts, naming the settings to change; a shorter context fits and launches."""
    shape = {
        "max_position_embeddings": 2048,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
    }
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(shape))
    assert kv_bytes_per_token(folder, "bfloat16") == 128 << 10
    tiers = {"l0_gpu": {"capacity_mb": 256}, "l2_disk": {"path": "kv"}}
    local = {**VLLM, "dtype": "bfloat16", "models": {"a": "/a", "b": "/b"}}
    s = settings(tmp_path, local_runner=local, attention_store={"tiering": tiers, **NO_DECOUPLE})
    with pytest.raises(ModelLoadError) as refused:
        vllm_launch(vllm_config(s, tmp_path), "a", folder, 8123, "/tmp/x.sock")
    assert str(refused.value) == (
        "model 'a': one turn of its 2048-token context needs 256 MB of KV in vLLM's memory, but "
        "attention_store.tiering.l0_gpu.capacity_mb gives it 128 MB, its share of 2 local models: "
        "raise capacity_mb, or lower attention_store.position_encoding.max_context_tokens"
    )
    shorter = settings(
        tmp_path,
        local_runner=local,
        attention_store={
            **NO_DECOUPLE,
            "tiering": tiers,
            "position_encoding": {"decouple": False, "max_context_tokens": 1024},
        },
    )
    argv = vllm_launch(vllm_config(shorter, tmp_path), "a", folder, 8123, "/tmp/x.sock").argv
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    # A model whose layers hold less than full KV (here a sliding window) is vLLM's to judge.
    (folder / "config.json").write_text(json.dumps({**shape, "sliding_window": 512}))
    assert kv_bytes_per_token(folder, "bfloat16") is None
    vllm_launch(vllm_config(s, tmp_path), "a", folder, 8123, "/tmp/x.sock")


def test_without_the_store_vllm_runs_without_the_connector(tmp_path):
    s = settings(tmp_path, local_runner=VLLM, attention_store={"enabled": False, **NO_DECOUPLE})
    launch = vllm_launch(vllm_config(s, tmp_path), "m", tmp_path, 8123, "/tmp/x.sock")
    assert "--kv-transfer-config" not in launch.argv and launch.socket_path is None


def test_dtype_auto_is_float32_only_on_a_cpu_without_bfloat16_arithmetic(monkeypatch):
    monkeypatch.setattr(Path, "exists", lambda self: False)  # no /dev/nvidia0
    assert vllm_dtype("auto", "auto", frozenset({"avx2"})) == "float32"
    assert vllm_dtype("auto", "auto", frozenset({"avx512_bf16"})) == "bfloat16"
    assert vllm_dtype("auto", "cuda:1", frozenset()) == "bfloat16"
    assert vllm_dtype("bfloat16", "auto", frozenset()) == "bfloat16"


def test_vllms_stream_reads_as_deltas_finish_and_usage():
    assert parse_event(b'data: {"choices":[{"text":"Hi","finish_reason":null}]}\n') == [Delta("Hi")]
    assert parse_event(b'data: {"choices":[{"text":"","finish_reason":"length"}]}') == [Finish("length")]
    stopped = b'data: {"choices":[{"text":"","finish_reason":"stop","stop_reason":"END"}]}'
    assert parse_event(stopped) == [Finish("stop", "END")]  # the stop string that matched
    eos = b'data: {"choices":[{"text":"","finish_reason":"stop","stop_reason":2}]}'
    assert parse_event(eos) == [Finish("stop")]  # a stop token id is no stop sequence
    assert parse_event(b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}') == [
        TokenUsage(5, 2)
    ]
    assert parse_event(b'data: {"error":{"message":"boom"}}') == [StreamError("boom")]
    assert parse_event(b"data: [DONE]") == [] and parse_event(b"\n") == [] and parse_event(b": ping") == []


def test_a_tiers_capacity_is_shared_by_the_local_models_of_either_engine(tmp_path):
    """Each local model keeps its own store (and, on vLLM, its own server): a tier's capacity_mb is the
    tier's whole size, split evenly between them, never held once per model."""
    from proxy.local.build import open_stores
    from tests.tiny_model import tiny_loaded

    tiers = {"l0_gpu": {"capacity_mb": 256}, "l1_host": {"capacity_mb": 64}, "l2_disk": {"capacity_mb": 1024}}
    two = {"a": "/a.gguf", "b": "/b.gguf"}
    embedded = parse_settings(
        orjson.dumps({"local_runner": {"models": two}, "attention_store": {"tiering": tiers}}),
        tmp_path,
        env={},
        check_paths=False,
    )
    lm = tiny_loaded()
    stores = open_stores(embedded, {"a": lm, "b": lm}, base_dir=tmp_path)
    try:
        for store in stores.values():
            config = store.config
            assert (config.l0_capacity_bytes, config.l1_capacity_bytes, config.l2_capacity_bytes) == (
                128 << 20,
                32 << 20,
                512 << 20,
            )
    finally:
        for store in stores.values():
            store.close()
    on_vllm = settings(
        tmp_path, local_runner={**VLLM, "models": two}, attention_store={"tiering": tiers, **NO_DECOUPLE}
    )
    config = vllm_config(on_vllm, tmp_path)
    assert config.kv_cache_bytes == 128 << 20 and config.connector is not None
    assert config.connector["l1_capacity_bytes"] == 32 << 20
    assert config.connector["l2_capacity_bytes"] == 512 << 20
