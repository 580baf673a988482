"""The CUDA step's kernel configs chosen by measurement (local_runner/kernel_choice.py): the fastest
config that ran and agreed is chosen, one that fails or differs is left out, the default stays within
the margin, "auto" batch invariance follows the invariant product's cost against cuBLAS, and a choice is
kept in a file that the next start reads (a malformed one is measured again). On a CPU the kernels run
under Triton's interpreter; the timings are given by the test (the interpreter's are no device's), but
for one measurement end to end with the real timer. On CUDA, a model's step is prepared with a choice
measured on the device, shown in /healthz's description."""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch

pytest.importorskip("triton")

from local_runner import kernel_choice as kc  # noqa: E402
from local_runner import triton_attention as ta  # noqa: E402
from local_runner import triton_ops  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.float16  # the interpreter's bfloat16 products are wrong (triton_attention.py)

SHAPE = kc.ModelShape(
    heads=4, kv_heads=2, head_dim=32, page_tokens=16, dtype=DTYPE, prompt_rows=24, decode_jobs=2, context=48
)
WEIGHTS = [torch.randn(48, 32).to(DTYPE).to(DEVICE), torch.randn(32, 48).to(DTYPE).to(DEVICE)]
DEFAULT = ta.config_for(DTYPE)
FAST = ta.AttentionConfig(block_n=16)
BROKEN = ta.AttentionConfig(block_m=128)
WRONG = ta.AttentionConfig(block_n=32)


class Launches:
    """Records the config of every attention and invariant-product launch, and can break or spoil the
    launches of a config (as a device that cannot take its tiles, or a kernel that computes wrongly)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.last: object = None
        self.broken: set[object] = set()
        self.wrong: set[object] = set()
        attend, linear = ta.attend, triton_ops.linear

        def recorded_attend(q, k, v, meta, scale):
            return self._launch(meta.config, functools.partial(attend, q, k, v, meta, scale))

        def recorded_linear(x, w, config=triton_ops.ENGINE_LINEAR):
            return self._launch(config, functools.partial(linear, x, w, config))

        monkeypatch.setattr(ta, "attend", recorded_attend)
        monkeypatch.setattr(triton_ops, "linear", recorded_linear)

    def _launch(self, config, run):
        self.last = config
        if config in self.broken:
            raise RuntimeError("out of resources: shared memory")
        out = run()
        return out + 1 if config in self.wrong else out

    def timer(self, seconds: dict[object, float]):
        """A timer that runs the call once and says it took seconds[its config] (None: cuBLAS)."""

        def timer(fn, calls):
            self.last = None
            fn()
            return seconds[self.last]

        return timer


def _choose(tmp_path, timer, *, invariant=False, attention=(DEFAULT, FAST, BROKEN, WRONG), linear=None):
    return kc.choose(
        SHAPE,
        DEVICE,
        invariant=invariant,
        weights=WEIGHTS,
        folder=tmp_path,
        timer=timer,
        attention=attention,
        linear=linear or kc.LINEAR_CANDIDATES[:2],
    )


def _never(fn, calls):
    raise AssertionError("a kept choice is not measured again")


def test_the_fastest_config_that_ran_and_agreed_is_chosen_and_kept(tmp_path, monkeypatch):
    launches = Launches(monkeypatch)
    launches.broken.add(BROKEN)
    launches.wrong.add(WRONG)
    timer = launches.timer({DEFAULT: 1.0, FAST: 0.6, WRONG: 0.1})
    choice, invariant = _choose(tmp_path, timer)
    assert choice.attention == FAST and invariant is False and choice.linear is None
    how = choice.attention_how
    assert how.startswith("measured in") and "x0.60" in how and "2 of 4 candidates ran" in how
    assert "out of resources" in how and "differs at" in how
    [kept] = tmp_path.glob("attention-float16-*.json")
    assert json.loads(kept.read_text())["config"] == {
        "block_m": 64,
        "block_n": 16,
        "num_warps": 4,
        "num_stages": 2,
    }
    again, _ = _choose(tmp_path, _never)
    assert again.attention == FAST and again.attention_how.startswith("kept: measured in")
    assert "attention" in again.describe() and "block_n=16" in again.describe()["attention"]

    kept.write_text(
        '{"config": {"block_m": 48}, "how": "x"}'
    )  # a tile the kernel cannot take: measured again
    third, _ = _choose(tmp_path, timer)
    assert third.attention == FAST and third.attention_how.startswith("measured in")


def test_the_default_stays_unless_another_is_faster_by_the_margin(tmp_path, monkeypatch):
    launches = Launches(monkeypatch)
    choice, _ = _choose(tmp_path, launches.timer({DEFAULT: 1.0, FAST: 0.99}), attention=(DEFAULT, FAST))
    assert choice.attention == DEFAULT and "within x0.98 of the default, kept" in choice.attention_how


def test_candidates_past_the_time_budget_are_not_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(kc, "BUDGET_S", 0.0)
    launches = Launches(monkeypatch)
    choice, _ = _choose(tmp_path, launches.timer({DEFAULT: 1.0, FAST: 0.5}), attention=(DEFAULT, FAST))
    assert choice.attention == DEFAULT and "1 not timed (past 0 s)" in choice.attention_how


def test_one_time_budget_bounds_both_measurements(tmp_path, monkeypatch):
    """The engine's start waits for the attention's and the product's measurements together: time the
    attention spent is not the product's to spend again."""
    monkeypatch.setattr(kc, "BUDGET_S", 0.2)
    launches = Launches(monkeypatch)
    first, second = kc.LINEAR_CANDIDATES[:2]
    seconds = {DEFAULT: 1.0, None: 1.0, first: 1.1, second: 1.0}
    timer = launches.timer(seconds)

    def slow_attention(fn, calls):
        spent = timer(fn, calls)
        if launches.last == DEFAULT:
            time.sleep(0.1)  # three points: the budget is gone when the product's measurement starts
        return spent

    choice, _ = _choose(tmp_path, slow_attention, invariant=None, attention=(DEFAULT,))
    assert choice.linear == first and "1 not timed (past 0 s)" in choice.linear_how, choice.linear_how


def test_each_models_products_keep_a_choice_of_their_own(tmp_path, monkeypatch):
    """Two models of the same heads but other hidden sizes: each measures its own products and keeps its
    own file (neither reads, nor deletes, the other's)."""
    launches = Launches(monkeypatch)
    first, second = kc.LINEAR_CANDIDATES[:2]
    timer = launches.timer({DEFAULT: 1.0, None: 1.0, first: 1.3, second: 1.1})
    _choose(tmp_path, timer, invariant=None, attention=(DEFAULT,))
    wider = [torch.randn(64, 32).to(DTYPE).to(DEVICE), torch.randn(32, 64).to(DTYPE).to(DEVICE)]
    other, _ = kc.choose(
        SHAPE,
        DEVICE,
        invariant=None,
        weights=wider,
        folder=tmp_path,
        timer=timer,
        attention=(DEFAULT,),
        linear=kc.LINEAR_CANDIDATES[:2],
    )
    assert other.linear_how.startswith("measured in"), other.linear_how
    assert len(list(tmp_path.glob("linear-*.json"))) == 2
    again, _ = _choose(tmp_path, _never, invariant=None, attention=(DEFAULT,))
    assert again.linear_how.startswith("kept:")


def test_a_measurement_where_nothing_runs_keeps_the_default_and_keeps_nothing(tmp_path, monkeypatch):
    launches = Launches(monkeypatch)
    launches.broken.update({DEFAULT, FAST})
    choice, _ = _choose(tmp_path, launches.timer({}), attention=(DEFAULT, FAST))
    assert choice.attention == DEFAULT and choice.attention_how.startswith("default (measurement failed")
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("cost,expected", [(1.1, True), (1.3, False)])
def test_auto_batch_invariance_follows_the_invariant_products_cost(tmp_path, monkeypatch, cost, expected):
    launches = Launches(monkeypatch)
    first, second = kc.LINEAR_CANDIDATES[:2]
    seconds = {DEFAULT: 1.0, None: 1.0, first: cost + 0.2, second: cost}
    choice, invariant = _choose(tmp_path, launches.timer(seconds), invariant=None, attention=(DEFAULT,))
    assert invariant is expected and choice.linear == second and choice.invariant_cost == pytest.approx(cost)
    assert f"batch_invariant auto: {'on' if expected else 'off'}" in choice.linear_how
    assert "invariant_product" in choice.describe()
    kept, again = _choose(tmp_path, _never, invariant=None, attention=(DEFAULT,))
    assert again is expected and kept.linear == second and kept.linear_how.startswith("kept:")
    # asked for: on whatever it costs
    assert _choose(tmp_path, _never, invariant=True, attention=(DEFAULT,))[1] is True


def test_a_measurement_end_to_end(tmp_path):
    """The real timer and kernels (the interpreter's on a CPU): a config chosen among those that ran,
    kept, and read back by the next start."""
    timer = functools.partial(kc.timed, reps=1)
    attention = kc.attention_candidates(DTYPE)[:2]
    choice, invariant = _choose(tmp_path, timer, invariant=None, attention=attention)
    assert choice.attention in attention and choice.attention_how.startswith("measured in")
    assert "2 of 2 candidates ran" in choice.attention_how
    assert choice.linear in kc.LINEAR_CANDIDATES[:2] and choice.invariant_cost is not None
    assert isinstance(invariant, bool)
    assert len(list(tmp_path.glob("*.json"))) == 2
    again, _ = _choose(tmp_path, _never, invariant=None, attention=attention)
    assert again.attention == choice.attention and again.linear == choice.linear


def test_the_candidates_start_with_the_engines_configs():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        candidates = kc.attention_candidates(dtype)
        assert candidates[0] == ta.config_for(dtype) and len(set(candidates)) == len(candidates)
    assert kc.LINEAR_CANDIDATES[0] == triton_ops.ENGINE_LINEAR
    assert kc.device_key(DEVICE).startswith("cuda-" if CUDA else "cpu-triton-interpreter-")


@pytest.mark.skipif(not CUDA, reason="the engine measures its kernels on CUDA only")
def test_a_cuda_step_is_prepared_with_kernels_measured_on_the_device(tmp_path, monkeypatch):
    from local_runner import exact_kernel
    from local_runner.decoder import fuse_projections
    from local_runner.model_step import ModelStep
    from local_runner.packed_attention import use_packed_attention
    from tests.tiny_model import tiny_llama, tiny_loaded

    monkeypatch.setattr(exact_kernel, "_cache_dir", tmp_path)
    # two candidates each: what is tested is the way through, not the device's speed (compiles are seconds)
    monkeypatch.setattr(kc, "LINEAR_CANDIDATES", kc.LINEAR_CANDIDATES[:2])
    candidates = kc.attention_candidates
    monkeypatch.setattr(kc, "attention_candidates", lambda dtype: candidates(dtype)[:2])
    model = tiny_llama(seed=7)
    fuse_projections(model)
    lm = tiny_loaded(model=model, device="cuda")
    use_packed_attention(lm.model)
    prepare = functools.partial(
        ModelStep.prepare,
        lm,
        slots=4,
        context=256,
        batch=True,
        batch_invariant=None,
        compile=False,
        max_rows=64,
    )
    step = prepare()
    assert step.cuda is not None and step.kernels is not None
    assert step.cuda.attention == step.kernels.attention
    assert step.kernels.invariant_cost is not None
    assert step.batch_invariant == (step.kernels.invariant_cost <= kc.INVARIANT_COST_BOUND)
    assert "kernels" in step.describe()
    assert len(list((tmp_path / "kernels").glob("cuda-*/*.json"))) == 2
    again = prepare()
    assert again.kernels.attention_how.startswith("kept:")
