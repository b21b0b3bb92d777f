"""The convergence experiment's bookkeeping: pairing, gaps, spread, resumability."""

import json

import pytest

from experiments import convergence


def _record(name, val, bytes_per_step, seed=0):
    return {
        "name": name, "val_loss": val, "train_loss": val + 0.01, "wire_bytes_per_step": bytes_per_step,
        "config": {"steps": 10, "seed": seed}, "wall_s": 1.0, "tokens_per_s": 100.0, "nonfinite_steps": 0,
        "n_params": 1000, "n_devices": 8,
        "history": [{"step": 5, "val_loss": val + 0.5}, {"step": 10, "val_loss": val}],
    }


def _write(run_dir, vals):
    for name, val in vals.items():
        b = 100.0 if name.startswith("fp32") else 25.0
        (run_dir / f"{name}.json").write_text(json.dumps(_record(name, val, b)))


def test_summary_pairs_quantized_runs_with_the_first_fp32_seed(tmp_path):
    names = [n for n, _ in convergence.runs()]
    vals = {n: 2.0 for n in names}
    vals.update({"fp32-seed0": 2.0, "fp32-seed1": 2.1, "fp32-seed2": 1.9, "qsdp-W4G4": 3.0})
    _write(tmp_path, vals)
    s = convergence.summarise(tmp_path, names)
    assert s["fp32_mean_val_loss"] == pytest.approx(2.0)
    assert s["fp32_spread"] == pytest.approx(0.2)
    rows = {r["name"]: r for r in s["runs"]}
    assert rows["qsdp-W4G4"]["gap_to_paired_fp32"] == pytest.approx(0.5)
    assert not rows["qsdp-W4G4"]["inside_fp32_spread"]
    assert rows["qsdp-W8G8"]["inside_fp32_spread"]
    assert rows["qsdp-W8G8"]["bytes_ratio_vs_fp32"] == pytest.approx(4.0)
    text = convergence.table(s)
    assert "qsdp-W4G4" in text and "+50.00%" in text


def test_summary_waits_for_every_run(tmp_path):
    names = [n for n, _ in convergence.runs()]
    _write(tmp_path, {n: 2.0 for n in names[:-1]})
    assert convergence.summarise(tmp_path, names) is None


def test_runs_share_the_paired_seed():
    runs = dict(convergence.runs(seed=7))
    assert runs["fp32-seed1"]["seed"] == 8 and runs["fp32-seed2"]["seed"] == 9
    assert all(kw["seed"] == 7 for n, kw in runs.items() if not n.startswith("fp32-seed"))


def test_unknown_run_name_is_an_error(tmp_path, capsys):
    assert convergence.main(["--only", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown runs" in capsys.readouterr().err


def test_plot_is_written(tmp_path):
    names = [n for n, _ in convergence.runs()]
    _write(tmp_path, {n: 2.0 for n in names})
    convergence.plot(tmp_path, names, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
