"""Tests for experiments.shelf.timing (deterministic: fake clock, fake callables)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.shelf.timing import (
    TimingResult,
    default_sync,
    format_results,
    median_ratio,
    quantile,
    time_alternating,
)

REPO = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make_fns(clock, durations, log):
    """name -> callable that logs its name and advances the clock by its next duration."""
    its = {n: iter(ds) for n, ds in durations.items()}

    def mk(n):
        def f():
            log.append(n)
            clock.t += next(its[n])
            return n

        return f

    return {n: mk(n) for n in durations}


def test_alternation_order_rotates_each_round():
    clock, log = FakeClock(), []
    fns = make_fns(clock, {k: [1.0] * 10 for k in "abc"}, log)
    time_alternating(fns, repeats=3, warmup=1, sync=lambda x: x, clock=clock)
    warm, meas = log[:3], log[3:]
    assert warm == ["a", "b", "c"]
    assert meas == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_no_rotation_option():
    clock, log = FakeClock(), []
    fns = make_fns(clock, {k: [1.0] * 10 for k in "ab"}, log)
    time_alternating(fns, repeats=3, warmup=0, sync=lambda x: x, clock=clock, rotate=False)
    assert log == ["a", "b"] * 3


def test_warmup_excluded_and_reported():
    clock, log = FakeClock(), []
    durs = {"a": [50.0, 7.0, 1.0, 2.0, 3.0], "b": [60.0, 8.0, 4.0, 4.0, 4.0]}
    res = time_alternating(make_fns(clock, durs, log), repeats=3, warmup=2, sync=lambda x: x, clock=clock)
    assert res["a"].warmup_s == (50.0, 7.0)
    assert res["a"].first_call_s == 50.0
    assert res["a"].samples == (1.0, 2.0, 3.0)
    assert res["b"].samples == (4.0, 4.0, 4.0)
    assert res["b"].first_call_s == 60.0
    assert list(res) == ["a", "b"]


def test_statistics_on_known_durations():
    clock, log = FakeClock(), []
    durs = {"x": [1.0, 4.0, 2.0, 100.0, 3.0]}
    r = time_alternating(make_fns(clock, durs, log), repeats=5, warmup=0, sync=lambda x: x, clock=clock)["x"]
    assert r.first_call_s is None
    assert r.samples == (1.0, 4.0, 2.0, 100.0, 3.0)  # call order kept
    assert r.median == 3.0
    assert r.min == 1.0 and r.max == 100.0
    assert r.mean == pytest.approx(22.0)
    assert r.q1 == 2.0 and r.q3 == 4.0 and r.iqr == 2.0
    d = r.to_dict()
    assert d["median_s"] == 3.0 and d["iqr_s"] == 2.0 and d["samples_s"] == [1.0, 4.0, 2.0, 100.0, 3.0]


def test_quantile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = sorted([0.3, 1.7, 2.2, 9.0, 4.4, 4.5])
    for q in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))
    assert math.isnan(quantile([], 0.5))
    with pytest.raises(ValueError):
        quantile(xs, 1.5)


def test_sync_called_on_result_before_clock_stops():
    events = []

    def clock():
        events.append("clock")
        return float(len(events))

    def fn():
        events.append("call")
        return "out"

    def sync(x):
        events.append(f"sync:{x}")

    time_alternating({"f": fn}, repeats=1, warmup=0, sync=sync, clock=clock)
    assert events == ["clock", "call", "sync:out", "clock"]


def test_block_alias_and_conflict():
    seen = []
    time_alternating({"f": lambda: 1}, repeats=2, warmup=0, block=seen.append)
    assert seen == [1, 1]
    with pytest.raises(TypeError):
        time_alternating({"f": lambda: 1}, repeats=1, sync=print, block=print)


def test_default_sync_blocks_nested_leaves():
    class Fake:
        def __init__(self):
            self.blocked = 0

        def block_until_ready(self):
            self.blocked += 1
            return self

    a, b = Fake(), Fake()
    tree = {"x": [a, (b, 3)], "y": None}
    assert default_sync(tree) is tree
    assert a.blocked == 1 and b.blocked == 1


def test_default_sync_with_jax_array():
    jnp = pytest.importorskip("jax.numpy")
    res = time_alternating({"sum": lambda: jnp.arange(1000.0).sum()}, repeats=2, warmup=1)
    assert res["sum"].n == 2 and res["sum"].median >= 0 and res["sum"].first_call_s > 0


def test_median_ratio_and_format():
    r = {
        "full": TimingResult("full", (4.0, 4.0, 4.0)),
        "quant": TimingResult("quant", (1.0, 2.0, 3.0), warmup_s=(9.0,)),
    }
    assert median_ratio(r, "full", "quant") == 2.0
    assert median_ratio(r, "quant", "full") == 0.5
    table = format_results(r)
    assert "full" in table and "quant" in table and "9000.000" in table


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(fns={}, repeats=1),
        dict(fns={"a": 1}, repeats=1),
        dict(fns={"a": lambda: 0}, repeats=0),
        dict(fns={"a": lambda: 0}, repeats=1, warmup=-1),
    ],
)
def test_argument_validation(kwargs):
    with pytest.raises((ValueError, TypeError)):
        time_alternating(**kwargs)


def test_module_does_not_import_jax():
    code = "import sys, experiments.shelf.timing; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
