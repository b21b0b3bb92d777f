"""Usage errors for out-of-range trainer flags, strict JSON in metrics.jsonl, and the failure
workload's save attempt (it called an unimported ``save_or_explain``)."""

from __future__ import annotations

import json
import math

import pytest

from experiments.gpt import train as tg
from experiments.gpt.files import dumps_strict
from experiments.gpt.run_files import MetricsLog


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--failure-timeout", "0"], "argument --failure-timeout: expected a number of seconds > 0, got '0'"),
        (["--failure-timeout", "-3"], "argument --failure-timeout: expected a number of seconds > 0"),
        (["--failure-timeout", "nan"], "argument --failure-timeout: expected a number of seconds > 0"),
        (["--lr", "-0.001"], "argument --lr: expected a finite number > 0, got '-0.001'"),
        (["--lr", "inf"], "argument --lr: expected a finite number > 0"),
        (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
        (["--seed", "-5"], "argument --seed: expected an integer >= 0, got -5"),
        (["--seed", str(2**32)], "argument --seed: expected an integer in [0, 2**32)"),
        (["--min-shard-size", "-1"], "argument --min-shard-size: expected an integer >= 0"),
        (["--process-id", "-1"], "argument --process-id: expected an integer >= 0"),
        (["--init-timeout", "0"], "argument --init-timeout: expected a positive integer, got 0"),
        (["--peer-timeout", "-2"], "argument --peer-timeout: expected a finite number > 0"),
    ],
)
def test_out_of_range_flags_are_usage_errors(flags, message, capsys, tmp_path):
    """Refused by the parser (exit 2, message naming the flag and what it accepts) before jax
    starts or anything is written; --failure-timeout 0 used to turn the watchdog off silently,
    -3 to fail with a traceback after the whole setup."""
    out = tmp_path / "never"
    assert tg.main([*flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err, err
    assert not out.exists()


def _strict(line: str):
    def refuse(name):
        raise ValueError(f"not JSON: bare {name}")

    return json.loads(line, parse_constant=refuse)


def test_metrics_lines_are_strict_json_and_read_back(tmp_path):
    """A diverged loss (NaN) or an infinite gradient norm is written as a string, so every line
    parses as strict JSON; a resumed run reads the floats back."""
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    rows = [
        {"step": 1, "loss": 5.5, "grad_norm": 1.0, "nonfinite": 0, "seconds": 0.1, "val_loss": None},
        {"step": 2, "loss": math.nan, "grad_norm": math.inf, "nonfinite": 1, "seconds": 0.1, "val_loss": -math.inf},
    ]
    for r in rows:
        log.append(r)
    log.close()
    lines = path.read_text().splitlines()
    parsed = [_strict(line) for line in lines]  # raises on a bare NaN / Infinity
    assert parsed[1]["loss"] == "NaN" and parsed[1]["grad_norm"] == "Infinity"
    assert parsed[1]["val_loss"] == "-Infinity" and parsed[0]["val_loss"] is None
    again = MetricsLog(path, start_step=2)
    assert math.isnan(again.rows[1]["loss"]) and again.rows[1]["grad_norm"] == math.inf
    assert again.rows[1]["val_loss"] == -math.inf and again.rows[0] == rows[0]
    assert _strict(dumps_strict({"a": [math.nan, 1.0]})) == {"a": ["NaN", 1.0]}


def test_failure_workload_saves_when_its_watchdog_fires(tmp_path, monkeypatch, capsys):
    """The workload's save attempt runs (it named ``save_or_explain`` without importing it, and
    the watchdog reported the NameError as "The save failed")."""
    from experiments.shelf import failure_workload as fw
    from qsdp_jax import watchdog
    from qsdp_jax.checkpoint import Checkpointer

    class Exited(Exception):
        pass

    def leave(code):
        raise Exited(code)

    class FiresAtFirstStep(watchdog.StepWatchdog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, _exit=leave, **kwargs)

        def beat(self, step):
            super().beat(step)
            self.fail(RuntimeError("Connection reset by peer"))

    monkeypatch.setattr(watchdog, "StepWatchdog", FiresAtFirstStep)
    with pytest.raises(Exited):
        fw.train(tmp_path, steps=3, every=100, bound=60, save_timeout=30, what="process 0 of 1")
    err = capsys.readouterr().err
    assert "The save failed" not in err, err
    assert "Saved step 1" in err, err
    with Checkpointer(tmp_path / "checkpoints") as c:
        assert c.latest_step() == 1


def test_watchdog_says_where_a_save_attempt_failed(capsys):
    """A bug in ``on_timeout`` (the workload's NameError) names its file and line."""
    from qsdp_jax.watchdog import StepWatchdog

    exits = []

    def broken():
        return undefined_name  # noqa: F821 - the bug under test

    dog = StepWatchdog(60, on_timeout=broken, _exit=exits.append, what="test")
    dog.fail(RuntimeError("Connection reset by peer"))
    err = capsys.readouterr().err
    assert exits == [75]
    assert "The save failed: NameError: name 'undefined_name' is not defined (at test_cli_ranges.py:" in err, err
