"""experiments.convergence.frontier on synthetic records: paired gaps, intervals, bits per element, table, plots."""

import math

import pytest
from convergence_records import fake_record

from experiments.convergence import frontier, runbook

FP32 = {0: 2.0, 1: 2.1, 2: 1.9}
# paired gaps +1%, +1%, +0.5%: mean 0.8333%, sd 0.2887%, half width 4.302653 * sd / sqrt(3)
W8 = {0: 2.02, 1: 2.121, 2: 1.9095}
HALF = 4.302653 * (0.005 / math.sqrt(3)) / math.sqrt(3)


def _records():
    recs = {}

    def add(corpus, config, seed, val, wire):
        recs[runbook.RunKey(corpus, config, seed)] = fake_record(corpus, config, seed, val, wire)

    for s, v in FP32.items():
        add("shakespeare", "fp32", s, v, 400.0)
    for s, v in W8.items():
        add("shakespeare", "qsdp-sr-W8G8", s, v, 100.0)
    for s in (0, 1):
        add("shakespeare", "bf16", s, FP32[s], 200.0)
    add("shakespeare", "qsdp-W4G4", 0, 3.0, 50.0)  # one seed: no interval
    add("shakespeare", "qsdp-W6G6", 7, 2.0, 75.0)  # seed 7 has no fp32 run
    add("kjv", "fp32", 0, 1.5, 400.0)
    return recs


def _row(summary, corpus, name):
    return next(r for r in summary["corpora"][corpus]["configs"] if r["name"] == name)


def test_paired_gap_interval_by_hand():
    s = frontier.summarise(_records(), {"steps": 10})
    r = _row(s, "shakespeare", "qsdp-sr-W8G8")
    assert r["paired_gap"] == pytest.approx({"0": 0.01, "1": 0.01, "2": 0.005})
    assert r["gap"]["mean"] == pytest.approx(0.0083333, abs=1e-7)
    assert r["gap"]["half_width"] == pytest.approx(HALF, rel=1e-6)
    assert r["gap"]["n"] == 3 and r["gap_interval_contains_zero"] is False  # [+0.12%, +1.55%]
    sp = s["corpora"]["shakespeare"]["fp32_spread"]
    assert sp["sd_relative"] == pytest.approx(0.05) and sp["range_relative"] == pytest.approx(0.1)


def test_bits_per_element_against_the_fp32_step():
    s = frontier.summarise(_records())
    assert _row(s, "shakespeare", "fp32")["bits_per_element"] == pytest.approx(32.0)
    bf16 = _row(s, "shakespeare", "bf16")
    assert bf16["bits_per_element"] == pytest.approx(16.0)
    assert bf16["gap_interval_contains_zero"] is True  # gaps 0, 0: a zero-width interval at 0
    w8 = _row(s, "shakespeare", "qsdp-sr-W8G8")
    assert w8["bits_per_element"] == pytest.approx(8.0)
    assert w8["bytes_ratio_vs_fp32"] == pytest.approx(4.0)
    assert w8["wire_bits_per_param"] == pytest.approx(8 * 100.0 / 1000)


def test_one_seed_and_unpaired_seeds_are_reported_not_hidden():
    s = frontier.summarise(_records())
    w4 = _row(s, "shakespeare", "qsdp-W4G4")
    assert w4["gap"]["mean"] == pytest.approx(0.5) and w4["gap"]["half_width"] is None
    w6 = _row(s, "shakespeare", "qsdp-W6G6")
    assert w6["gap"] is None and w6["unpaired_seeds"] == [7]
    assert [r["name"] for r in s["corpora"]["kjv"]["configs"]] == ["fp32"]
    assert "over 1 seed(s); one seed, no spread yet." in frontier.markdown_table(s, "kjv")
    assert "seed" not in w4["qsdp"] and w4["qsdp"]["weight_bits"] == 4
    assert list(s["corpora"]) == ["shakespeare", "kjv"]
    assert len(s["runs"]) == 11 and s["interval"].startswith("mean over seeds")


def test_markdown_table():
    s = frontier.summarise(_records())
    md = frontier.markdown_table(s, "shakespeare")
    assert md.startswith(
        "**shakespeare**: fp32 mean validation loss 2.0000 over 3 seed(s); seed-to-seed sd 5.00%, range 10.00%."
    )
    lo, hi = 100 * (0.0083333 - HALF), 100 * (0.0083333 + HALF)
    assert (
        f"| qsdp-sr-W8G8 | 8.00 | 0.00 | 4.00x | 3 | 2.0168 | +0.83% [{lo:+.2f}%, {hi:+.2f}%] "
        "| +1.00%, +1.00%, +0.50% | **no** |"
    ) in md
    assert "| qsdp-W4G4 | 4.00 | 0.00 | 8.00x | 1 | 3.0000 | +50.00% (1 seed, no interval) |" in md
    assert "| qsdp-W6G6 | 6.00 |" in md and "no paired seed" in md
    assert "| fp32 | 32.00 |" in md and "reference" in md
    assert "no fp32 run yet" in frontier.markdown_table(
        frontier.summarise({k: v for k, v in _records().items() if k.config != "fp32"}), "shakespeare"
    )


def test_frontier_points_pareto_first():
    s = frontier.summarise(_records())
    pts = frontier.frontier_points(s, "shakespeare")
    # W4G4 (4 bits, +50%) and W8 (8 bits, +0.83%) are Pareto; bf16 (16 bits, 0%) too
    assert [p[0] for p in pts] == ["qsdp-W4G4", "qsdp-sr-W8G8", "bf16"]


def test_plots_are_written(tmp_path):
    recs = _records()
    s = frontier.summarise(recs)
    frontier.plot_frontier(s, tmp_path / "f.png")
    frontier.plot_curves(recs, tmp_path / "c.png")
    for name in ("f.png", "c.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
