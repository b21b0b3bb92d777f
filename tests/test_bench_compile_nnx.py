"""experiments.bench.compile_nnx on the toy model: rows for the GSPMD step and the front door's,
written as measured, and a rerun resumes (skips what the JSON holds)."""

import json

from experiments.bench import compile_nnx


def test_rows_are_written_and_a_rerun_resumes(tmp_path, capsys):
    out = tmp_path / "compile.json"
    assert compile_nnx.main(["--model", "small", "--steps", "gspmd", "fp32", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["scheme"], r["compiler"]) for r in rows] == [
        ("small", "gspmd", "XLA:CPU"),
        ("small", "fp32", "XLA:CPU"),
    ]
    assert all(r["compile_s"] > 0 and r["peak_bytes"] > 0 for r in rows)
    assert compile_nnx.main(["--model", "small", "--steps", "gspmd", "fp32", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == rows  # nothing measured again
    assert "| small | fp32 |" in capsys.readouterr().out
