"""experiments.convergence.stats: t quantiles against published values and closed forms, intervals by hand."""

import math

import numpy as np
import pytest

from experiments.convergence import stats

# two-sided 95% critical values t_{0.975, df}, as printed in standard tables
T975 = {
    1: 12.7062,
    2: 4.3027,
    3: 3.1824,
    4: 2.7764,
    5: 2.5706,
    6: 2.4469,
    9: 2.2622,
    10: 2.2281,
    20: 2.0860,
    30: 2.0423,
    60: 2.0003,
    120: 1.9799,
}


@pytest.mark.parametrize("df,expected", sorted(T975.items()))
def test_t_quantile_matches_the_table(df, expected):
    assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995, 0.9995])
def test_t_quantile_matches_closed_forms(p):
    # df=1 is the Cauchy distribution; df=2 has t = (2p-1) / sqrt(2p(1-p))
    assert stats.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-7)
    assert stats.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-7)


def test_t_quantile_tends_to_the_normal():
    assert stats.t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)
    assert stats.t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("p,df", [(0.4, 3), (1.0, 3), (0.975, 0)])
def test_t_quantile_rejects_bad_input(p, df):
    with pytest.raises(ValueError, match="invalid"):
        stats.t_quantile(p, df)


def test_mean_interval_by_hand():
    # [1, 2, 3]: mean 2, sd 1, half width t_{0.975,2} / sqrt(3) = 4.302653 / 1.732051
    iv = stats.mean_interval([1.0, 2.0, 3.0])
    assert (iv.mean, iv.sd, iv.n) == (2.0, 1.0, 3)
    assert iv.half_width == pytest.approx(2.484138, abs=1e-6)
    assert iv.contains(0.0) and not iv.contains(4.5)
    d = iv.as_dict()
    assert d["low"] == pytest.approx(2 - 2.484138, abs=1e-6) and d["level"] == 0.95


def test_mean_interval_other_level_and_one_value():
    iv = stats.mean_interval([0.0, 2.0], level=0.90)  # sd sqrt(2), t_{0.95,1} = 6.313752
    assert iv.half_width == pytest.approx(6.313752 * math.sqrt(2) / math.sqrt(2), abs=1e-5)
    one = stats.mean_interval([0.5])
    assert one.half_width is None and one.low is None and one.contains(0.5) is None


def test_interval_covers_the_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = sum(stats.mean_interval(rng.normal(1.0, 2.0, size=3)).contains(1.0) for _ in range(2000))
    assert 0.935 < hits / 2000 < 0.965  # a z-interval (1.96) would cover only ~76% with n=3


@pytest.mark.parametrize("values", [[], [[1.0, 2.0]], [1.0, float("nan")]])
def test_mean_interval_rejects_bad_values(values):
    with pytest.raises(ValueError, match="values"):
        stats.mean_interval(values)


def test_paired_relative_gaps_use_common_seeds_only():
    gaps = stats.paired_relative_gaps({0: 2.2, 1: 1.98, 5: 3.0}, {0: 2.0, 1: 2.0, 2: 2.0})
    assert gaps == pytest.approx({0: 0.1, 1: -0.01})


def test_spread():
    s = stats.spread([1.9, 2.0, 2.1])
    assert s["mean"] == pytest.approx(2.0) and s["sd"] == pytest.approx(0.1)
    assert s["range_relative"] == pytest.approx(0.1) and s["sd_relative"] == pytest.approx(0.05)
    assert stats.spread([2.0])["sd"] is None
