"""The connector's worker side: restores into vLLM's paged blocks layer by layer, saves finished requests'
KV from them layer by layer, and never makes a step wait on a disk.

Per engine step (connector.py calls these from vLLM's hooks):

- `begin` (the step's plan is bound, before its forward): each save of a request that finished in an
  earlier step (its blocks held for it) gets its slots.
- `start_loads` (before the forward of a step with loads): each load starts on the store's load thread
  (kvtier restores layer i while the model computes layer i - 1).
- `layer_loaded(i)` (before layer i's attention): layer i of every load is in host memory by now
  (the scheduler only lets a request in once its disk chunks are prefetched), it is written into its
  blocks. A chunk that fails its checksum makes the load's blocks invalid: vLLM recomputes them.
- `save_layer(i)` (after layer i's attention): layer i of each finished request is copied out of its
  blocks, so the copying rides along with this step's forward.
- `end_step`: layers not copied yet (an empty step has no forward) are copied now; the store's `put`
  (its memory copy and the background L2 write) runs on a thread of its own, and the requests' blocks
  go back to vLLM at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier.config import ChunkRef, PrefixMatch
from kvtier.restored_kv import KVLoadError, RestoredKV
from kvtier.store import KVStore

from .pages import PagedLayer, Slots
from .plan import LoadSpec, SaveSpec, StepPlan, StoredChunk, block_slots, blocks_of, covering_chunks
from .service import StoreService

log = logging.getLogger(__name__)


@dataclass
class _Load:
    spec: LoadSpec
    restored: RestoredKV
    offset: int  # where spec.start sits in the restored tokens
    end: int  # the last position restored (+1): spec.end, or less when the store has less now
    slots: Slots
    written: set[int] = field(default_factory=set)
    failed: bool = False


@dataclass
class _Save:
    spec: SaveSpec
    slots: Slots
    layers: list[tuple[torch.Tensor, torch.Tensor] | None]


class WorkerSide:
    def __init__(
        self,
        store: KVStore,
        service: StoreService,
        layers: Sequence[PagedLayer],
        layer_names: Sequence[str],
        *,
        layerwise: bool = True,
    ) -> None:
        self.store = store
        self.service = service
        self.layers = list(layers)
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.block_size = self.layers[0].block_size
        self.layerwise = layerwise
        self._pending: list[LoadSpec] = []  # bound, not started
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._saved: set[str] = set()  # requests whose blocks may be freed
        self._invalid: set[int] = set()  # blocks whose restore failed
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="attnstore-vllm-save")

    # ---- one step -------------------------------------------------------------------------------------

    def begin(self, plan: StepPlan) -> None:
        self._saves = [self._prepare_save(spec) for spec in plan.saves]
        self._pending = list(plan.loads)

    def start_loads(self) -> None:
        started = [self._start_load(spec) for spec in self._pending]
        self._pending = []
        self._loads.extend(load for load in started if load is not None)
        if not self.layerwise:
            for i in range(len(self.layers)):
                self.layer_loaded(i)

    def layer_loaded(self, i: int) -> None:
        if self._pending:
            self.start_loads()
        for load in self._loads:
            if load.failed or i in load.written:
                continue
            load.written.add(i)
            try:
                k, v = load.restored.layer(i)
            except KVLoadError as exc:
                self._fail(load, exc)
                continue
            n = load.end - load.spec.start
            self.layers[i].scatter(
                load.slots, k[0, :, load.offset : load.offset + n], v[0, :, load.offset : load.offset + n]
            )

    def save_layer(self, i: int) -> None:
        for save in self._saves:
            if save.layers[i] is None:
                save.layers[i] = self.layers[i].gather(save.slots)

    def end_step(self) -> None:
        if self._pending:
            self.start_loads()
        for i in range(len(self.layers)):
            self.layer_loaded(i)  # a no-op unless a layer's attention never ran
            self.save_layer(i)
        for save in self._saves:
            self.service.begin_put(save.spec.namespace)
            self._saver.submit(self._put, save.spec, save.layers)
            self._saved.add(save.spec.req_id)
        self._loads, self._saves = [], []

    def finished_saving(self) -> set[str]:
        """Requests whose blocks vLLM may free now (their KV is copied out)."""
        done, self._saved = self._saved, set()
        return done

    def invalid_blocks(self) -> set[int]:
        """Blocks whose restore failed since the last call: vLLM recomputes from the first of them."""
        bad, self._invalid = self._invalid, set()
        return bad

    def close(self) -> None:
        """Finish the saves handed over, then the store's own writes (a restart finds every chunk)."""
        self._saver.shutdown(wait=True)
        self.store.close()

    # ---- loads ------------------------------------------------------------------------------------------

    def _start_load(self, spec: LoadSpec) -> _Load | None:
        """Restore [spec.start, spec.end) from the chunks the store holds now; what it no longer holds
        (evicted since the scheduler looked) is marked invalid for vLLM to recompute."""
        match = self.store.lookup(spec.namespace, spec.token_ids, count=False)
        end = min(spec.end, match.tokens)
        if end < spec.end:
            self._invalid |= blocks_of(max(end, spec.start), spec.end, spec.block_ids, self.block_size)
            self._lost(spec)
        if end <= spec.start:
            return None
        stored = [StoredChunk(c.start, c.n_tokens, c.tier) for c in match.chunks]
        picked, offset = covering_chunks(stored, spec.start, end)
        refs = [match.chunks[i] for i in picked]
        last = refs[-1]
        refs[-1] = ChunkRef(last.key, last.start, min(last.n_tokens, end - last.start), last.tier)
        sub = PrefixMatch(spec.namespace, sum(c.n_tokens for c in refs), tuple(refs))
        restored = self.store.load(sub)
        layer = self.layers[0]
        slots = layer.slots(*block_slots(spec.start, end, spec.block_ids, self.block_size))
        return _Load(spec, restored, offset, end, slots)

    def _fail(self, load: _Load, exc: Exception) -> None:
        log.warning("attnstore: restoring %s failed, vLLM recomputes it: %s", load.spec.req_id, exc)
        load.failed = True
        self._invalid |= blocks_of(load.spec.start, load.spec.end, load.spec.block_ids, self.block_size)
        self._lost(load.spec)

    def _lost(self, spec: LoadSpec) -> None:
        if spec.turn is not None:
            self.service.load_failed(spec.turn, ("l1", "l2"))

    # ---- saves ------------------------------------------------------------------------------------------

    def _prepare_save(self, spec: SaveSpec) -> _Save:
        slots = self.layers[0].slots(*block_slots(0, len(spec.token_ids), spec.block_ids, self.block_size))
        return _Save(spec, slots, [None] * len(self.layers))

    def _put(self, spec: SaveSpec, layers: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """On the saver thread: into the store (memory now, L2 in the background)."""
        keys: list[str] = []
        try:
            ready = [kv for kv in layers if kv is not None]
            keys = self.store.put(spec.namespace, spec.token_ids, ready, session=spec.session)
        except Exception:
            log.exception("attnstore: saving %s failed", spec.req_id)
        finally:
            self.service.end_put(spec.namespace)
            if spec.turn is not None:
                self.service.saved(spec.turn, keys)
