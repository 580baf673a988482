"""The dense path on the CPU: every linear layer's weight packed once for oneDNN (what inductor's
`freezing` does, without a compile), projections fused, and row tiles for batch invariance.

Why: a step is mostly matrix products of a few rows (one per decoding job) against every weight of the
model. torch's default CPU path for `F.linear` takes about twice as long for a few rows as for one,
while a weight reordered once for oneDNN's blocked kernels is read at close to memory speed whatever the
row count (docs/engine.md, "Batched steps").

Packing is per linear module (any architecture): float32 always, bfloat16 where the CPU has AVX-512 BF16
or AVX-NE-CONVERT (elsewhere the module stays as it is). Not on CUDA. Whether a kernel computes each row
the same way whatever the number of rows beside it depends on the shape (a 1536 -> 576 product here
does not): `batch_invariant` measures every shape at start (`make_rows_invariant`); a shape whose rows
agree from some small row count on (two: the one-row kernel is the odd one out) gets at least that many
rows per call; one whose every row of a small call is computed as alone, up to some row count where
another kernel takes over (oneDNN's bfloat16 products on AMX past 32 rows), gets calls of at most that
many rows; any other fixed tiles of rows.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("attnstore.runner")


class PackedLinear(nn.Module):
    """y = x W^T + b with W reordered for oneDNN once (no autograd: inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


class ExactLinear(nn.Module):
    """y = x W^T + b on exact_linear.cpp's AMX kernel (bfloat16, a CPU with AMX): every row by the same
    tile instructions whatever the number of rows beside it, so batch invariance needs no tiling, and a
    prompt chunk is one call that reads each weight once (oneDNN's calls had to be cut at 32 rows)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.attnstore.amx_pack(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnstore.amx_linear(x, self.packed, self.bias)


def fits_exact_linear(linear: nn.Linear) -> bool:
    """Whether ExactLinear serves this layer's shape and dtype (the kernel's tiles: multiples of 32)."""
    return (
        linear.weight.dtype == torch.bfloat16
        and linear.in_features % 32 == 0
        and linear.out_features % 32 == 0
    )


def can_pack_linears(dtype: torch.dtype, device: torch.device) -> str | None:
    """None when linear weights of this dtype can be packed here, else why not."""
    if device.type != "cpu":
        return f"{device.type} runs its own matrix kernels"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if dtype == torch.float32:
        return None
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except RuntimeError as exc:
        return f"oneDNN cannot pack {str(dtype).removeprefix('torch.')} weights on this CPU ({exc})".split(
            "\n"
        )[0]
    return None


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` rows (x itself when it has that many)."""
    missing = rows - x.shape[0]
    return x if missing <= 0 else torch.cat((x, x.new_zeros(missing, x.shape[1])))


def rows_are_independent(
    linear: nn.Module,
    in_features: int,
    dtype: torch.dtype,
    max_rows: int,
    device: torch.device,
    min_rows: int = 1,
) -> bool:
    """Is every row's result bit for bit the one it gets in a call of `min_rows` rows (alone, for 1),
    whatever the number of rows beside it (min_rows to max_rows)? A property of the kernels torch picks
    for this shape on this machine, so it is measured (on sampled rows and row counts: every count up to
    40, those around each power of two, and the largest). Where a kernel of its own rounds one row alone
    while every larger call agrees, `min_rows=2` holds (what each CPU measured: docs/engine.md, "Batch
    invariance")."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max_rows, in_features, generator=g).to(dtype=dtype, device=device)
    sampled = sorted(
        {*range(min(17, max_rows)), 31, 32, 63, 64, 127, 128, 255, 256, max_rows - 1} & set(range(max_rows))
    )
    powers = {p + d for p in (64, 128, 256, 512, 1024) for d in (-1, 0, 1)}
    sizes = sorted({*range(2, 41), *powers, max_rows} & set(range(max(2, min_rows + 1), max_rows + 1)))
    with torch.inference_mode():
        alone = {r: linear(_padded(x[r : r + 1], min_rows))[:1] for r in sampled}
        for n in sizes:
            out = linear(x[:n])
            if not all(torch.equal(out[r : r + 1], alone[r]) for r in sampled if r < n):
                return False
    return True


def pack_linears(model: nn.Module, exact: bool = False) -> tuple[int, int]:
    """Replace every nn.Linear of `model` by a PackedLinear, or by an ExactLinear where `exact` (the
    kernel is built and runs here) and the layer fits it (a tied output head gets a packed copy of its
    own; the embedding keeps the original). Returns how many of each."""
    packed = exact_count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if exact and fits_exact_linear(child):
                    setattr(parent, name, ExactLinear(child))
                    exact_count += 1
                else:
                    setattr(parent, name, PackedLinear(child))
                    packed += 1
    return packed, exact_count


class RowsPaddedLinear(nn.Module):
    """A linear layer whose calls are given padded rows (zeros) so that each row's result comes from a
    kernel that rounds it the same way whatever rows share the step; subclasses say how many rows."""

    def __init__(self, inner: nn.Module, in_features: int, rows: int) -> None:
        super().__init__()
        self.inner = inner
        self.in_features = in_features
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = self.multiply(flat)[: flat.shape[0]]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def multiply(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FixedRowsLinear(RowsPaddedLinear):
    """Exactly `rows` rows per call (the last tile padded): batch invariance for kernels whose result
    depends on the row count (costs up to rows - 1 padded rows)."""

    def multiply(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.shape[0]
        return torch.cat([self.inner(tile) for tile in _padded(flat, n + (-n) % self.rows).split(self.rows)])


class MinRowsLinear(RowsPaddedLinear):
    """At least `rows` rows per call: batch invariance for kernels that round a call of few rows (one,
    typically: a matrix-vector kernel of its own) differently from every larger one. Costs a padded row
    or so at decoding; a prompt chunk is one call, as unwrapped."""

    def multiply(self, flat: torch.Tensor) -> torch.Tensor:
        return self.inner(_padded(flat, self.rows))


class MaxRowsLinear(RowsPaddedLinear):
    """At most `rows` rows per call, nothing padded: batch invariance for kernels that compute every row
    of a call of up to `rows` rows as they compute it alone, and switch to another kernel (another
    rounding) past that (oneDNN's bfloat16 products on AMX past 32 rows: docs/engine.md, "Batch
    invariance"). Costs nothing at
    decoding; a prompt chunk is cut into calls of `rows` rows."""

    def multiply(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] <= self.rows:
            return self.inner(flat)
        return torch.cat([self.inner(tile) for tile in flat.split(self.rows)])


class ProjectionSlice(nn.Module):
    """What was q_proj (k_proj, gate_proj, ...) before its weight joined a fused projection: for
    transformers' own forward (the reference path) it computes the fused product and keeps its columns
    [lo, hi). The fused module is looked up on its owner at each call, so a later wrapper is honoured."""

    def __init__(self, owner: nn.Module, attribute: str, lo: int, hi: int) -> None:
        super().__init__()
        self.__dict__["_owner"] = owner  # not a submodule: the owner already holds the fused module
        self.attribute = attribute
        self.lo, self.hi = lo, hi
        self.in_features = getattr(owner, attribute).in_features
        self.out_features = hi - lo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.__dict__["_owner"], self.attribute)(x)[..., self.lo : self.hi]


def fuse(owner: nn.Module, parts: tuple[str, ...], fused_name: str) -> bool:
    """Replace the nn.Linear children `parts` of `owner` (same input, all with or all without bias) by one
    nn.Linear `fused_name` whose output is theirs side by side: one matrix product instead of several
    (fewer calls, a wider product). The parts become ProjectionSlice views for transformers' forward.
    False (nothing changed) where they do not fit."""
    mods = [getattr(owner, name, None) for name in parts]
    if not all(isinstance(m, nn.Linear) for m in mods):
        return False
    linears_ = [m for m in mods if isinstance(m, nn.Linear)]
    if len({m.in_features for m in linears_}) != 1 or len({m.bias is None for m in linears_}) != 1:
        return False
    first = linears_[0]
    fused = nn.Linear(
        first.in_features,
        sum(m.out_features for m in linears_),
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears_]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in linears_ if m.bias is not None]))
    fused.requires_grad_(False)
    setattr(owner, fused_name, fused)
    lo = 0
    for name, m in zip(parts, linears_, strict=True):
        setattr(owner, name, ProjectionSlice(owner, fused_name, lo, lo + m.out_features))
        lo += m.out_features
    return True


def linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, int]]:
    """(parent, attribute, module, in_features) of every (packed or plain) linear layer."""
    found: list[tuple[nn.Module, str, nn.Module, int]] = []
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear | PackedLinear | ExactLinear):
                found.append((parent, name, child, child.in_features))
    return found


# How a shape's calls are laid out for batch invariance, as measured (and kept on disk): "any" (every
# row as alone in a call of any size: unwrapped), "at-least-N" (MinRowsLinear), "at-most-N"
# (MaxRowsLinear), "tiles" (FixedRowsLinear). Tried in this order, the cheapest first: a padded row or
# so at decoding; then extra calls for long prompt chunks only, the fewest first; then padded tiles.
MIN_ROWS_TRIED = (2, 4, 8, 16)
MAX_ROWS_TRIED = (256, 128, 64, 32, 16)
TILES = "tiles"


def measure_rule(
    child: nn.Module, in_features: int, dtype: torch.dtype, max_rows: int, device: torch.device
) -> str:
    """The cheapest rule under which `child`'s rows do not depend on the rows beside them (see above)."""
    if rows_are_independent(child, in_features, dtype, max_rows, device):
        return "any"
    for rows in MIN_ROWS_TRIED:
        if rows <= max_rows and rows_are_independent(child, in_features, dtype, max_rows, device, rows):
            return f"at-least-{rows}"
    for rows in MAX_ROWS_TRIED:
        if rows < max_rows and rows_are_independent(child, in_features, dtype, rows, device):
            return f"at-most-{rows}"
    return TILES


def is_rule(rule: object) -> bool:
    """Whether `rule` is one measure_rule gives (a kept file is checked before it is trusted)."""
    if rule in ("any", TILES):
        return True
    if not isinstance(rule, str):
        return False
    kind, _, rows = rule.rpartition("-")
    return kind in ("at-least", "at-most") and rows.isdigit() and int(rows) > 0


def wrap(child: nn.Module, in_features: int, rule: str, tile: int) -> RowsPaddedLinear | None:
    """`child` laid out by `rule` (None: it stays as it is)."""
    if rule == "any":
        return None
    if rule == TILES:
        return FixedRowsLinear(child, in_features, tile)
    kind, _, rows = rule.rpartition("-")
    return (MinRowsLinear if kind == "at-least" else MaxRowsLinear)(child, in_features, int(rows))


def shape_key(child: nn.Module, in_features: int) -> str:
    """What a linear layer's kernel choice depends on besides the machine and dtype: its class (packed or
    not), sizes and bias."""
    bias = getattr(child, "bias", None) is not None
    return f"{type(child).__name__}:{in_features}x{int(getattr(child, 'out_features', 0))}:{'bias' if bias else 'nobias'}"


def make_rows_invariant(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    max_rows: int,
    tile: int = 16,
    measured: dict[str, str] | None = None,
) -> bool:
    """Make every linear layer of `model` compute each row independently of the rows beside it, for steps
    of up to `max_rows` rows, by the cheapest rule measured for its shape (measure_rule): layers measured
    independent stay as they are; the others get at least N rows per call, at most N, or padded tiles of
    `tile` rows. Idempotent. Returns whether every layer was measured independent afterwards (False: the
    model answers, but batch invariance is not assured).

    `measured`: the rule by shape_key from an earlier run on this machine, torch and dtype (the engine
    keeps it on disk, so a restart does not measure again); shapes it lacks are measured and added to
    it. Only the shapes measured now are verified again."""
    found = [f for f in linears(model) if not isinstance(f[0], RowsPaddedLinear)]
    by_shape = measured if measured is not None else {}
    known = set(by_shape)
    for _, _, child, in_features in found:
        shape = shape_key(child, in_features)
        if shape not in by_shape:
            by_shape[shape] = measure_rule(child, in_features, dtype, max_rows, device)
    wrapped_by_shape: dict[str, RowsPaddedLinear] = {}
    for parent, name, child, in_features in found:
        shape = shape_key(child, in_features)
        wrapped = wrap(child, in_features, by_shape[shape], tile)
        if wrapped is None:
            continue
        setattr(parent, name, wrapped)
        if shape not in known:
            wrapped_by_shape.setdefault(shape, wrapped)
    shapes = {shape_key(child, in_features) for _, _, child, in_features in found}
    log.info(
        "batch_invariant: %d linear layers, %d shapes (%d measured now, up to %d rows; the others as"
        " measured before on this machine); rows per call (tiles: padded to %d): %s",
        len(found),
        len(shapes),
        len(shapes - known),
        max_rows,
        tile,
        {shape: by_shape[shape] for shape in sorted(shapes)},
    )
    return all(
        rows_are_independent(m, m.in_features, dtype, max_rows, device) for m in wrapped_by_shape.values()
    )
