"""The packed step compiled: decoder.py's forward traced once by torch.compile (inductor), attention left
to an opaque operator.

Why: on this 2-core CPU a decode step of SmolLM2-135M is ~60% linear products (memory-bound) and ~35%
small operations and their Python: the norms, the rotary arithmetic, SiLU, residual adds, each a
separate kernel with its own dispatch. Inductor fuses those into a few generated C++ loops and, with
`freezing`, packs the linear weights for oneDNN itself (what dense.py does for the eager path). vLLM
compiles its models the same way and keeps attention out of the graph the same way (an opaque op that
reads the step's metadata from a context set before the call).

Shapes: the number of tokens in a step and of rows whose logits are wanted vary, so both sizes are
unbacked symbols: one graph serves every step, a lone decoding token included (torch would otherwise
compile a size of 1 apart). ModelStep compiles it on a thread of its own after start while jobs run on
the eager step. The generated C++ kernels are cached on disk
(`use_cache_dir`), but with frozen weights inductor recompiles the graph's code at every start (its FX
graph cache skips graphs with frozen constants): docs/benchmarks.md, "What a start costs", has the figures.

Any failure to compile falls back to the eager forward, said once in the log; the step then computes
what it computes without compiling.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch._dynamo.decorators import mark_unbacked

from .decoder import DecoderStack
from .packed_attention import PackedPlan, attend

log = logging.getLogger("attnstore.runner")

_OP = "attnstore::packed_attend"

# The compiled stacks by id: the attention operator is process-wide (torch's operator registry) and
# can take only tensors and numbers, so it finds its stack's current plan here. Weak: a stack that is
# dropped leaves no entry behind.
_STACKS: weakref.WeakValueDictionary[int, CompiledStack] = weakref.WeakValueDictionary()


@torch.library.custom_op(_OP, mutates_args=())
def _packed_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stack: int, layer: int) -> torch.Tensor:
    """One layer's attention for the current step of compiled stack `stack` (writes the new tokens' K/V
    into their slots as a side effect, as the eager path does)."""
    return _STACKS[stack].attend(q, k, v, layer)


@_packed_attend.register_fake
def _packed_attend_shape(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stack: int, layer: int
) -> torch.Tensor:
    return q.new_empty(q.shape)


class _Traced(nn.Module):
    """What torch.compile sees: the model as a submodule (so that `freezing` takes its weights as
    constants) and the stack's forward with attention as the opaque operator."""

    def __init__(self, model: nn.Module, stack: DecoderStack, key: int) -> None:
        super().__init__()
        self.model = model
        self.stack = stack  # a plain object over self.model's modules: nothing registered twice
        self.key = key

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        op = torch.ops.attnstore.packed_attend
        key = self.key

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return op(q, k, v, key, layer)

        return self.stack.run(ids, positions, keep, attend)


class CompiledStack:
    """A DecoderStack's forward, compiled; `forward` has DecoderStack.forward's signature."""

    def __init__(self, model: nn.Module, stack: DecoderStack) -> None:
        self.stack = stack
        self._plan: PackedPlan | None = None
        _STACKS[id(self)] = self
        traced = _Traced(model, stack, id(self))
        self._fn = torch.compile(traced, dynamic=True)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        assert self._plan is not None, "the attention operator ran outside a compiled step"
        return attend(self._plan, layer, q, k, v, self.stack.scaling)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor:
        wanted = keep.shape[0]
        if not wanted:  # a prompt chunk before the last: one row's logits, dropped (no empty product)
            keep = keep.new_full((1,), ids.shape[0] - 1)
        self._plan = plan
        try:
            # Sizes unbacked: one graph for every token count, 1 included (a backed size of 1 would get a
            # graph of its own: twice the compile time at start).
            for t in (ids, positions, keep):
                mark_unbacked(t, 0)
            # freezing: the weights become constants, so inductor packs them for oneDNN (torch.compile's
            # `options` does not reach that pass); patched per call, so any recompile is frozen too.
            with inductor_config.patch(freezing=True):
                return self._fn(ids, positions, keep)[:wanted]
        finally:
            self._plan = None


def use_cache_dir(folder: Path) -> None:
    """Keep inductor's compiled code under `folder`, beside the converted weights, so that it survives a
    restart (inductor reads TORCHINDUCTOR_CACHE_DIR at each use; importing it set a default in /tmp)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder.resolve())


def first_line(exc: BaseException) -> str:
    """A compiler error's first line (they run to pages), for the log and /healthz."""
    return (str(exc).strip().split("\n")[0][:200]) or type(exc).__name__
