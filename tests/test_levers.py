"""experiments.convergence.levers on synthetic records: the paired difference of a lever against its base."""

import math

import pytest
from convergence_records import fake_record

from experiments.convergence import frontier, levers, runbook

FP32 = {0: 2.0, 1: 2.1, 2: 1.9}
BASE = {0: 2.04, 1: 2.142, 2: 1.938}  # gaps +2%, +2%, +2%
GOLDEN = {0: 2.02, 1: 2.121, 2: 1.9095, 5: 1.0}  # gaps +1%, +1%, +0.5%; seed 5 has no fp32 run
LEVERS = (
    ("qsdp-sr-W4G4-golden", "qsdp-sr-W4G4", "golden rounding"),
    ("qsdp-sr-W4G4-b256", "qsdp-sr-W4G4", "not run: no row"),
)


def _summary():
    recs = {}
    for name, vals in (("fp32", FP32), ("qsdp-sr-W4G4", BASE), ("qsdp-sr-W4G4-golden", GOLDEN)):
        for s, v in vals.items():
            recs[runbook.RunKey("shakespeare", name, s)] = fake_record("shakespeare", name, s, v, 100.0)
    return levers.add_levers(frontier.summarise(recs), LEVERS)


def test_difference_of_paired_gaps_by_hand():
    (row,) = _summary()["corpora"]["shakespeare"]["levers"]  # the lever without runs is left out
    assert row["config"] == "qsdp-sr-W4G4-golden" and row["base"] == "qsdp-sr-W4G4"
    assert row["seeds"] == [0, 1, 2]  # seed 5 is not paired with fp32
    # (val_A - val_B) / fp32 per seed: -1%, -1%, -1.5%
    assert row["difference"] == pytest.approx({"0": -0.01, "1": -0.01, "2": -0.015})
    m = row["mean"]
    assert m["mean"] == pytest.approx(-0.0116667, abs=1e-7)
    sd = 0.005 / math.sqrt(3)  # sd of (-1, -1, -1.5) points
    assert m["half_width"] == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-6)
    assert row["interval_contains_zero"] is False


def test_one_shared_seed_has_no_interval_and_the_table_says_so():
    s = _summary()
    c = s["corpora"]["shakespeare"]
    c["configs"] = [dict(r, paired_gap={k: v for k, v in r["paired_gap"].items() if k == "0"}) for r in c["configs"]]
    (row,) = levers.lever_rows(c, LEVERS)
    assert row["seeds"] == [0] and row["mean"]["half_width"] is None
    assert row["interval_contains_zero"] is None
    c["levers"] = [row]
    assert (
        "| qsdp-sr-W4G4-golden | qsdp-sr-W4G4 | golden rounding | 1 | -1.00% (1 seed, no interval) | -1.00% |  |"
    ) in levers.markdown_table(s, "shakespeare")


def test_markdown_table():
    md = levers.markdown_table(_summary(), "shakespeare")
    assert md.startswith("**shakespeare, levers**")
    assert "| qsdp-sr-W4G4-golden | qsdp-sr-W4G4 | golden rounding | 3 | -1.17% [" in md
    assert "| -1.00%, -1.00%, -1.50% | **no** |" in md and "not run" not in md
    empty = levers.add_levers(frontier.summarise({}), LEVERS)
    assert empty["corpora"] == {}


def test_every_lever_names_two_runbook_configurations():
    for name, base, what in runbook.LEVERS:
        assert name in runbook.CONFIGS and base in runbook.CONFIGS and name != base and what
