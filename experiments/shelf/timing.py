"""Interleaved wall-clock timing of several callables (pure Python, jax optional).

``time_alternating`` runs warm-up calls first (their times, the first of which
includes compilation, are reported separately and never mixed into the
samples), then measures the callables round-robin, A B C, B C A, C A B, ...
(the starting callable rotates every round so that slow drift - thermal,
background load, a shaped network's token bucket - hits all of them equally).
Every call's result is synchronised (``block_until_ready``) before the clock is
read, so asynchronous JAX dispatch is measured to completion.

    res = time_alternating({"f32": lambda: f(x), "u8": lambda: g(q)}, repeats=20)
    print(format_results(res), median_ratio(res, "f32", "u8"))
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "TimingResult",
    "time_alternating",
    "median_ratio",
    "default_sync",
    "quantile",
    "format_results",
]


def quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default, 'type 7') of sorted data."""
    if not sorted_xs:
        return math.nan
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    frac = pos - lo
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * frac


@dataclasses.dataclass(frozen=True)
class TimingResult:
    """Samples (seconds) of one callable.  ``warmup_s[0]`` is compile + first run."""

    name: str
    samples: tuple[float, ...]
    warmup_s: tuple[float, ...] = ()

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def _sorted(self) -> list[float]:
        return sorted(self.samples)

    @property
    def median(self) -> float:
        return quantile(self._sorted, 0.5)

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else math.nan

    @property
    def max(self) -> float:
        return max(self.samples) if self.samples else math.nan

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else math.nan

    @property
    def stdev(self) -> float:
        if len(self.samples) < 2:
            return 0.0 if self.samples else math.nan
        m = self.mean
        return math.sqrt(sum((x - m) ** 2 for x in self.samples) / (len(self.samples) - 1))

    @property
    def q1(self) -> float:
        return quantile(self._sorted, 0.25)

    @property
    def q3(self) -> float:
        return quantile(self._sorted, 0.75)

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def first_call_s(self) -> float | None:
        """Time of the very first call (compilation + run), None without warm-up."""
        return self.warmup_s[0] if self.warmup_s else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable summary (seconds)."""
        return {
            "name": self.name,
            "n": self.n,
            "median_s": self.median,
            "min_s": self.min,
            "max_s": self.max,
            "mean_s": self.mean,
            "stdev_s": self.stdev,
            "q1_s": self.q1,
            "q3_s": self.q3,
            "iqr_s": self.iqr,
            "first_call_s": self.first_call_s,
            "warmup_s": list(self.warmup_s),
            "samples_s": list(self.samples),
        }


def _block_leaves(out: Any) -> None:
    if hasattr(out, "block_until_ready"):
        out.block_until_ready()
    elif isinstance(out, Mapping):
        for v in out.values():
            _block_leaves(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            _block_leaves(v)


def default_sync(out: Any) -> Any:
    """Wait until every array in the pytree ``out`` is computed.

    Uses ``jax.block_until_ready`` when jax is already imported (any jax array
    implies it is), else calls ``.block_until_ready()`` on leaves of nested
    lists/tuples/dicts that have it.  Never imports jax itself.
    """
    jax = sys.modules.get("jax")
    if jax is not None and hasattr(jax, "block_until_ready"):
        return jax.block_until_ready(out)
    _block_leaves(out)
    return out


def time_alternating(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    sync: Callable[[Any], Any] | None = None,
    *,
    block: Callable[[Any], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    rotate: bool = True,
) -> dict[str, TimingResult]:
    """Time each zero-argument callable ``repeats`` times, interleaved.

    Args:
      fns: name -> callable (order of the mapping is the order of round 0).
      repeats: measured calls per callable (>= 1).
      warmup: unmeasured calls per callable before measuring (>= 0), also
        interleaved; their durations go to ``TimingResult.warmup_s``.
      sync: called on each call's return value before the clock stops
        (default ``default_sync``: block_until_ready on the pytree).
      block: alias of ``sync`` (``jax.block_until_ready`` reads naturally here).
      clock: monotonic clock in seconds (inject a fake one in tests).
      rotate: rotate the starting callable each round (round r starts at the
        r-th callable), cancelling linear drift and "who goes first" effects.

    Returns name -> TimingResult, in the order of ``fns``.
    """
    if sync is not None and block is not None:
        raise TypeError("pass only one of sync= and block=")
    sync = sync if sync is not None else block if block is not None else default_sync
    if not fns:
        raise ValueError("fns is empty")
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"fns[{name!r}] is not callable")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")

    names = list(fns)
    warm: dict[str, list[float]] = {n: [] for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}

    def one_call(name: str) -> float:
        fn = fns[name]
        t0 = clock()
        out = fn()
        sync(out)
        t1 = clock()
        return t1 - t0

    def order(r: int) -> list[str]:
        if not rotate:
            return names
        k = r % len(names)
        return names[k:] + names[:k]

    for r in range(warmup):
        for name in order(r):
            warm[name].append(one_call(name))
    for r in range(repeats):
        for name in order(r):
            samples[name].append(one_call(name))

    return {n: TimingResult(name=n, samples=tuple(samples[n]), warmup_s=tuple(warm[n])) for n in names}


def median_ratio(results: Mapping[str, TimingResult], num: str, den: str) -> float:
    """``results[num].median / results[den].median`` (e.g. speedup = ratio(full, quant))."""
    d = results[den].median
    if d == 0:
        return math.inf if results[num].median > 0 else math.nan
    return results[num].median / d


def format_results(results: Mapping[str, TimingResult], unit: str = "ms") -> str:
    """A small fixed-width table of median / IQR / min / first call."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    w = max(4, *(len(n) for n in results))
    lines = [f"{'name':<{w}}  {'median':>10}  {'iqr':>10}  {'min':>10}  {'first':>10}  n   [{unit}]"]
    for n, r in results.items():
        first = r.first_call_s
        first_s = f"{first * scale:10.3f}" if first is not None else f"{'-':>10}"
        lines.append(
            f"{n:<{w}}  {r.median * scale:10.3f}  {r.iqr * scale:10.3f}  {r.min * scale:10.3f}  {first_s}  {r.n}"
        )
    return "\n".join(lines)
