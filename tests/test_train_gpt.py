"""The trainer CLI (experiments.gpt.train) end to end, and the demo's comparison table."""

from __future__ import annotations

import io
import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest

import qsdp_jax as q
from experiments.gpt import demo, train as tg
from experiments.gpt.report import Progress
from tests.trainer_flags import trainer_flags

SMALL = trainer_flags(d_model=32, n_layers=2, seq_len=32, batch=8)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One QSDP W8G8 run through main() (12 steps, validation at 6 and 12)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    code = tg.main([*SMALL, "--steps", "12", "--eval-every", "6", "--lr", "1e-2", "--warmup", "2", "--out", str(out)])
    assert code == 0
    return out


def test_run_writes_metrics_and_learns(run_dir):
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert set(rows[0]) >= {"step", "loss", "grad_norm", "nonfinite", "seconds", "val_loss"}
    assert [r["step"] for r in rows if r["val_loss"] is not None] == [6, 12]
    losses = [r["loss"] for r in rows]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1, losses
    assert sum(r["nonfinite"] for r in rows) == 0


def test_run_writes_config_summary_and_plot(run_dir):
    config = json.loads((run_dir / "config.json").read_text())
    assert config["name"] == "qsdp-sr-W8G8"  # the default weight rounding: stochastic
    assert config["qsdp"]["weight_rounding"] == "stochastic"
    assert config["qsdp"]["weight_bits"] == 8 and config["qsdp"]["bucket_size"] == 64
    assert config["model"]["d_model"] == 32 and config["model"]["seq_len"] == 32
    assert config["n_devices"] == 8
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "history" not in summary
    rows = _metrics(run_dir)
    assert summary["val_loss"] == pytest.approx(rows[-1]["val_loss"])
    assert summary["wire_bytes_per_step"] > 0
    assert any(k.startswith("all-gather/") for k in summary["wire_bytes_by_kind"])
    # The compiled fp32 step of the same model sends more: 8-bit weights and gradients.
    assert summary["bytes_ratio_vs_fp32"] > 1.5
    png = (run_dir / "loss.png").read_bytes()
    assert len(png) > 1000 and png.startswith(PNG_MAGIC)


def test_weight_rounding_flag():
    from experiments.gpt import args as train_args

    def rounding(*flags):
        return q.QSDPConfig(**train_args.qsdp_kwargs(train_args.parse_args(list(flags)))).weight_rounding

    assert rounding() == "stochastic"
    assert rounding("--weight-rounding", "shift") == "shift"
    assert rounding("--weight-rounding", "stochastic", "--weight-bits", "4") == "stochastic"


def test_existing_output_is_not_overwritten(run_dir, capsys):
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()}
    assert tg.main([*SMALL, "--steps", "4", "--out", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()}
    assert after == before


def test_overwrite_with_fp32_baseline(run_dir, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    (out / "notes.txt").write_text("kept")
    assert (
        tg.main([*SMALL, "--fp32", "--steps", "4", "--eval-every", "4", "--out", str(out), "--overwrite", "--quiet"])
        == 0
    )
    assert "fp32: train loss" in capsys.readouterr().out
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
    config = json.loads((out / "config.json").read_text())
    assert config["name"] == "fp32" and config["qsdp"]["weight_mode"] == "full"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bytes_ratio_vs_fp32"] == 1.0
    assert set(summary["wire_bytes_by_kind"]) <= {
        "all-gather/f32",
        "reduce-scatter/f32",
        "all-reduce/f32",
        "all-reduce/pred",  # the non-finite flag (optim.all_finite)
        "all-to-all/f32",
    }
    assert (out / "notes.txt").read_text() == "kept"  # only the run's own files are replaced


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--weight-mode", "full", "--weight-bits", "8"], "--weight-mode full"),
        (["--weight-mode", "comm", "--weight-bits", "none"], "needs --weight-bits"),
        (["--fp32", "--grad-bits", "4"], "--fp32 is unquantized"),
        (["--bf16", "--comm-dtype", "float32"], "--bf16 communicates in bfloat16"),
        (["--fp32", "--bf16"], "not allowed with"),
        (["--weight-bits", "9"], "1..8"),
        (["--weight-bits", "1", "--weight-rounding", "shift"], "weight_bits=1"),
        (["--bucket-size", "100"], "bucket_size=100"),
        (["--d-model", "30", "--n-heads", "4"], "n_heads=4"),
        (["--warmup", "50", "--steps", "10"], "warmup=50"),
        (["--batch", "12"], "multiple of 8"),
        (["--devices", "16", "--batch", "16"], "already set up with 8 device"),
        (["--data", "/nonexistent/text.txt"], "no such file"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert tg.main([*SMALL, "--steps", "10", *flags, "--out", str(out)]) == 2  # later flags win
    err = capsys.readouterr().err
    assert "usage:" in err and message in err, err
    assert not out.exists()


def test_help(capsys):
    assert tg.main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in (
        "--preset",
        "--weight-bits",
        "--grad-bits",
        "--weight-mode",
        "--fp32",
        "--bf16",
        "--devices",
        "--overwrite",
        "--comm-dtype",
    ):
        assert flag in text


class _FakeTrainer:
    """Stands in for experiments.gpt.trainer.Trainer: 3 steps, then the run fails."""

    def __init__(self, run, devices=None):
        from experiments.gpt.model import GPTConfig
        from experiments.gpt.trainer import StepLog

        self.run, self.n_devices, self._log = run, 8, StepLog
        self.model = types.SimpleNamespace(cfg=run.model_config(), count_params=lambda: 1)
        assert isinstance(self.model.cfg, GPTConfig)
        self.dataset = types.SimpleNamespace(val=np.zeros(4096, np.uint8), source="fake")

    def wire_report(self):
        return types.SimpleNamespace(total_bytes=1.0, table=lambda: "")

    def steps(self):
        for i in range(3):
            yield self._log(step=i + 1, loss=5.0 - i, grad_norm=1.0, nonfinite=0, seconds=0.01)
        raise RuntimeError("device lost")


def test_metrics_survive_a_failed_run(tmp_path, monkeypatch, capsys):
    from experiments.gpt import trainer

    monkeypatch.setattr(trainer, "Trainer", _FakeTrainer)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="device lost"):
        tg.main([*SMALL, "--fp32", "--steps", "10", "--out", str(out)])
    assert [r["loss"] for r in _metrics(out)] == [5.0, 4.0, 3.0]
    assert "stopped at step 3/10" in capsys.readouterr().err
    assert not (out / "summary.json").exists()


def test_progress_plain_lines_when_not_a_tty():
    stream = io.StringIO()
    p = Progress(total=100, tokens_per_step=256, stream=stream)
    for i in range(100):
        p.update(types.SimpleNamespace(step=i + 1, loss=3.0, seconds=0.01, val_loss=None))
    lines = stream.getvalue().splitlines()
    assert 10 <= len(lines) <= 12
    assert lines[-1].startswith("step 100/100") and "tok/s" in lines[-1] and "ETA 0:00:00" in lines[-1]
    assert "\r" not in stream.getvalue()


def test_demo_comparison_table():
    fp32 = dict(name="fp32", val_loss=2.0, train_loss=1.9, wire_bytes_per_step=4 * 2**20, tokens_per_s=20000.0)
    qsdp = dict(name="qsdp-W8G8", val_loss=2.02, train_loss=1.919, wire_bytes_per_step=2**20, tokens_per_s=15000.0)
    table = demo.comparison_table(fp32, qsdp)
    lines = table.splitlines()
    assert "fp32 FSDP" in lines[0] and "qsdp-W8G8" in lines[0]
    assert len({len(line) for line in lines}) <= 2  # aligned columns
    text = "\n".join(lines)
    for expected in ("2.0000", "2.0200", "+1.00%", "4.0 MiB", "1.0 MiB", "4.00x fewer", "20,000", "0.75x"):
        assert expected in text, (expected, text)
    c = demo.comparison(fp32, qsdp)
    assert c["bytes_ratio_fp32_over_qsdp"] == 4.0


@pytest.mark.parametrize("flags, limit", [([], 10), (["--max-skipped-steps", "3"], 3)])
def test_a_run_that_skips_every_update_stops_with_a_message(tmp_path, capsys, flags, limit):
    """--lr 1e30: every update is skipped for non-finite gradients. It used to train on to the
    end and exit 0 with "train loss nan"; now it stops after --max-skipped-steps in a row
    (default 10), status 1, saying why."""
    out = tmp_path / "run"
    code = tg.main(
        [*SMALL, "--fp32", "--quiet", "--no-fp32-ratio", "--lr", "1e30", "--warmup", "1"]
        + ["--steps", "40", "--eval-every", "40", *flags, "--out", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"the last {limit} steps all had non-finite gradients and skipped their update" in err, err
    rows = _metrics(out)
    assert len(rows) < 40 and [r["nonfinite"] for r in rows[-limit:]] == [1] * limit
    assert not (out / "summary.json").exists()


def test_skipped_steps_off_trains_to_the_end(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*SMALL, "--fp32", "--quiet", "--no-fp32-ratio", "--lr", "1e30", "--warmup", "1", "--steps", "12"]
    assert tg.main([*argv, "--eval-every", "12", "--max-skipped-steps", "0", "--out", str(out)]) == 0
    assert len(_metrics(out)) == 12
