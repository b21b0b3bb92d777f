"""Two trainer processes (``python -m experiments.gpt.train``, 2 x 4 simulated CPU devices) that
were started with different settings stop at once, both, naming the setting and both values
(they used to train on with process 0's record, or block until a gloo / barrier timeout)."""

from __future__ import annotations

import time

from tests.cluster_procs import run_trainers


def test_different_settings_stop_every_process_naming_them(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    codes = run_trainers(
        tmp_path,
        [["--out", str(out), "--lr", "3e-3"], ["--out", str(out), "--lr", "1e-2", "--seed", "1", "--weight-bits", "4"]],
        60,
    )
    took = time.monotonic() - t0
    logs = [(tmp_path / f"p{k}.log").read_text() for k in range(2)]
    print(f"both processes exited {codes} after {took:.1f} s (from their start)")
    assert codes == [2, 2], logs
    for text in logs:
        assert "the processes of this run were started with different trainer settings" in text, text
        assert "process 1 has --lr=0.01, process 0 has --lr=0.003" in text, text
        assert "process 1 has --seed=1, process 0 has --seed=0" in text, text
        assert "process 1 has --weight-bits=4, process 0 has --weight-bits=null" in text, text
        assert "Traceback" not in text and "Check failure" not in text, text
    assert not (out / "metrics.jsonl").exists()


def test_an_error_on_process_0_alone_stops_both(tmp_path):
    """Process 0 alone checks the output directory: a non-empty one is refused on both processes
    (process 1 used to go on and block in the first collective)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "old.txt").write_text("x")
    codes = run_trainers(tmp_path, [["--out", str(out)], ["--out", str(out)]], 60)
    logs = [(tmp_path / f"p{k}.log").read_text() for k in range(2)]
    assert codes == [2, 2], logs
    for text in logs:
        assert f"process 0: output directory {out} exists and is not empty" in text, text
