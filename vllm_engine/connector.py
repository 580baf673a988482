"""AttnStoreConnector: attnstore's tiered store under vLLM, through vLLM's v1 KV connector API.

    --kv-transfer-config '{"kv_connector": "AttnStoreConnector", "kv_connector_module_path":
        "vllm_engine.connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {...ConnectorOptions...}}'

vLLM's own paged KV memory plays L0; the store's host memory (L1) and disk (L2, shared by replicas and
kept across restarts) sit below it. Keys are the store's chained chunk keys, rooted in the tenant (the
request's kv_transfer_params, see plan.parse_params) and the model's fingerprint (weights, dtype, vLLM
version and attention backend). The store lives in the worker process, beside the KV tensors; the
scheduler and attnstore's engine (engine.py) reach it through its socket (link/wire.py).

vLLM's connector API is experimental, so this is written against one release (PINNED_VLLM) and refuses
any other at start. vLLM is imported only here and only if installed: attnstore never requires it.
One worker only (tensor and pipeline parallel size 1): with several, each would hold a shard of the
heads, which one store per engine cannot key yet.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .link.options import ConnectorOptions
from .link.plan import StepPlan, check_chunk_size, parse_params

if TYPE_CHECKING:
    import torch

    from .link.scheduler import SchedulerSide
    from .link.wire import StoreSocketServer
    from .link.worker import WorkerSide

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    _VLLM_MISSING: ImportError | None = None
except ImportError as exc:  # attnstore without vLLM: importable, not usable
    KVConnectorBase_V1 = KVConnectorMetadata = object
    KVConnectorRole = None
    _VLLM_MISSING = exc

log = logging.getLogger("vllm.attnstore")  # under vLLM's logger: its handlers print it
PINNED_VLLM = "0.32.0"


class AttnStoreMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the step's loads and saves."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class AttnStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _VLLM_MISSING is not None:
            raise ImportError(f"AttnStoreConnector needs vLLM {PINNED_VLLM}: {_VLLM_MISSING}")
        import vllm

        if vllm.__version__.split("+")[0] != PINNED_VLLM:
            raise RuntimeError(
                f"AttnStoreConnector is written for vLLM {PINNED_VLLM} (its connector API is experimental); this is {vllm.__version__}"
            )
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError("AttnStoreConnector serves one worker: tensor and pipeline parallel size 1")
        transfer = self._kv_transfer_config
        self.options = ConnectorOptions.from_extra(
            transfer.kv_connector_extra_config, transfer.engine_id or ""
        )
        self.block_size = vllm_config.cache_config.block_size
        check_chunk_size(self.options.chunk_tokens, self.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._server: StoreSocketServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to a preemption is a later miss, never a wrong answer

    # ---- scheduler side ---------------------------------------------------------------------------------

    def _make_scheduler(self) -> SchedulerSide:
        from .link.scheduler import SchedulerSide
        from .link.wire import StoreClient

        o = self.options
        return SchedulerSide(
            StoreClient(o.socket_path),
            block_size=self.block_size,
            lookahead=o.lookahead,
            prefetch=o.prefetch,
            scheduler_aware=o.scheduler_aware,
            save=o.save,
            max_prefetch_wait_s=o.max_prefetch_wait_s,
        )

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.bind_block_pool(gpu_block_pool)

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        params = parse_params(request.kv_transfer_params, getattr(request, "cache_salt", None))
        self._scheduler.arrived(request.request_id, list(request.prompt_token_ids or ()), params)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request.request_id, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        if num_external_tokens > 0:
            self._scheduler.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> AttnStoreMetadata:
        assert self._scheduler is not None
        new = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        resumed = list(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        return AttnStoreMetadata(self._scheduler.plan_step(new, resumed))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        pool = self._scheduler_block_pool()
        hashes = (
            [pool.blocks[b].block_hash for b in block_ids] if pool is not None else [None] * len(block_ids)
        )
        tokens = list(request.all_token_ids[: request.num_computed_tokens])
        return self._scheduler.finished(request.request_id, tokens, block_ids, hashes), None

    def _scheduler_block_pool(self) -> Any:
        return self._kv_cache_manager.block_pool if self._kv_cache_manager is not None else None

    # ---- worker side ------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from .link.setup import open_worker

        self._worker, self._server = open_worker(self._vllm_config, kv_caches, self.options)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, AttnStoreMetadata):
            self._worker.begin(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.layer_loaded(self._worker.index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_layer(self._worker.index[layer_name])

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.finished_saving() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.invalid_blocks() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Finish the saves in flight and close the store, so a restart finds every chunk."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._scheduler is not None:
            self._scheduler.client.close()


__all__ = ["PINNED_VLLM", "AttnStoreConnector", "AttnStoreMetadata"]
