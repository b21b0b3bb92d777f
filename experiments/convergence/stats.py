"""Small statistics for the convergence experiment: paired gaps, Student t intervals, spread.

numpy and the standard library only (no scipy). The t quantile is computed, not tabulated: the
Student t density is integrated numerically (Simpson's rule, after the substitution
``x = sqrt(df) tan(theta)``) and the CDF inverted by bisection, to ~1e-10; the tests check it
against published table values and against the closed forms for 1 and 2 degrees of freedom.

The interval reported for a configuration is the classical one for a mean of paired differences:
with per-seed relative gaps ``g_1..g_n`` (quantized run against the fp32 run of the same seed),
``mean(g) +- t_{(1+level)/2, n-1} * sd(g) / sqrt(n)``, ``sd`` with the ``n - 1`` denominator.
It assumes the per-seed gaps are independent draws from one normal distribution; with 3 seeds
the t quantile is 4.30, so the interval is wide on purpose.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["Interval", "mean_interval", "paired_relative_gaps", "spread", "t_quantile"]


def _t_cdf_upper_half(t: float, df: float, n: int = 2001) -> float:
    """P(0 <= T <= t) for t >= 0.

    With ``x = sqrt(df) tan(theta)`` the t density becomes ``c cos(theta)^(df-1)``, smooth and
    bounded on ``[0, pi/2)``, so Simpson's rule on ``n`` (odd) points is accurate to ~1e-12
    even far in the tails."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(math.pi)
    end = math.atan(t / math.sqrt(df))
    theta = np.linspace(0.0, end, n)
    y = np.cos(theta) ** (df - 1)
    h = end / (n - 1)
    integral = h / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum())
    return float(math.exp(log_c) * integral)


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``0.5 <= p < 1``)."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p={p!r} is invalid: must be in [0.5, 1)")
    if not df > 0:
        raise ValueError(f"df={df!r} is invalid: must be positive")
    target = p - 0.5
    lo, hi = 0.0, 1.0
    while _t_cdf_upper_half(hi, df) < target:  # bracket (df=1, p=0.9995 needs ~640)
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if _t_cdf_upper_half(mid, df) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclasses.dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with a two-sided Student t interval ``[low, high]``.

    ``half_width`` (and so ``low``/``high``) is ``None`` when ``n < 2``: one value has no
    interval."""

    mean: float
    half_width: float | None
    n: int
    sd: float | None
    level: float

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def contains(self, x: float) -> bool | None:
        """Whether ``x`` lies inside the interval (``None`` without an interval)."""
        hw = self.half_width
        return None if hw is None else self.mean - hw <= x <= self.mean + hw

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(low=self.low, high=self.high)
        return d


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of ``values`` with its two-sided ``level`` Student t confidence interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"values must be a non-empty 1-D sequence, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"values must be finite, got {x.tolist()}")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} is invalid: must be in (0, 1)")
    n = int(x.size)
    if n < 2:
        return Interval(mean=float(x[0]), half_width=None, n=1, sd=None, level=level)
    sd = float(x.std(ddof=1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean=float(x.mean()), half_width=half, n=n, sd=sd, level=level)


def paired_relative_gaps(values: Mapping[int, float], reference: Mapping[int, float]) -> dict[int, float]:
    """``(values[s] - reference[s]) / reference[s]`` for every seed ``s`` present in both."""
    return {s: (values[s] - reference[s]) / reference[s] for s in sorted(values) if s in reference}


def spread(values: Sequence[float]) -> dict:
    """Seed-to-seed spread: mean, sd (``n - 1``), range, and both relative to the mean."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("spread of no values")
    mean = float(x.mean())
    sd = float(x.std(ddof=1)) if x.size > 1 else None
    rng = float(x.max() - x.min())
    return {
        "n": int(x.size),
        "mean": mean,
        "sd": sd,
        "min": float(x.min()),
        "max": float(x.max()),
        "range": rng,
        "range_relative": rng / mean,
        "sd_relative": None if sd is None else sd / mean,
    }
