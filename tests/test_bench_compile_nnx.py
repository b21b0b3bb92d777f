"""experiments.bench.compile_nnx on the toy model: rows for the GSPMD step and the front door's,
written as measured, and a rerun resumes (skips what the JSON holds)."""

import json

from experiments.bench import compile_nnx


def test_rows_are_written_and_a_rerun_resumes(tmp_path, capsys):
    out = tmp_path / "compile.json"
    assert compile_nnx.main(["--model", "small", "--steps", "gspmd", "fp32", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["scheme"], r["compiler"], r["target"]) for r in rows] == [
        ("small", "gspmd", "XLA:CPU", "cpu"),
        ("small", "fp32", "XLA:CPU", "cpu"),
    ]
    assert all(r["compile_s"] > 0 and r["peak_bytes"] > 0 for r in rows)
    assert compile_nnx.main(["--model", "small", "--steps", "gspmd", "fp32", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == rows  # nothing measured again
    assert "| small | cpu (XLA:CPU) | fp32 |" in capsys.readouterr().out


def test_an_unknown_target_is_a_usage_error(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        compile_nnx.main(["--model", "small", "--target", "v9x-8"])
    assert e.value.code == 2 and "--target 'v9x-8': not one of" in capsys.readouterr().err
