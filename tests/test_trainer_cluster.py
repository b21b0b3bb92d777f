"""The trainer on several processes and on 2-D meshes: 2 processes x 4 CPU devices (gloo,
localhost) train to the same losses as 1 process x 8 devices; mesh and per-level-bits flags;
bad mesh input gives a usage error."""
import json
from pathlib import Path

import pytest

from experiments import train_gpt as tg
from experiments.multiproc import run_processes

DATA = Path(__file__).parent / "testdata" / "shakespeare_small.txt"
SMALL = ["--d-model", "32", "--n-heads", "2", "--n-layers", "2", "--seq-len", "32", "--batch", "8",
         "--bucket-size", "64", "--eval-batches", "1", "--data", str(DATA), "--steps", "3",
         "--eval-every", "3", "--no-fp32-ratio", "--quiet"]


def _losses(out: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]


TWO_LEVEL = ["--weight-bits", "8", "--grad-bits", "8", "--mesh", "node=2,local=4",
             "--inter-grad-bits", "4"]


def test_two_processes_match_one(tmp_path):
    """QSDP W8G8 (4-bit gradients across nodes) on a ("node", "local") = 2 x 4 mesh: 2 processes x
    4 devices train to the losses of 1 process x 8 devices, each process drawing only its own
    rows of every batch. Step 1's loss (the forward pass) is bitwise equal; later steps agree
    to 1e-6 relative, not bitwise (seen: 9e-8 relative at step 2). The cause is not pinned
    down: the step's own multi-process test (tests/test_multiproc_2level.py, same optimizer)
    is bitwise when compiled with the compiler option xla_backend_optimization_level=0; the
    trainer compiles with the defaults (XLA_FLAGS=--xla_backend_optimization_level=0 did not
    change these numbers; whether it reached the compiler was not checked). The two processes agree with each other bit for bit."""
    two = tmp_path / "two"
    res = run_processes("tests.trainer_worker", "train", num_processes=2, devices_per_process=4,
                        kwargs={"argvs": [[*SMALL, *TWO_LEVEL, "--out", str(two),
                                             "--process-logs", str(tmp_path / "logs")]]},
                        timeout_s=300)
    one = tmp_path / "one"
    assert tg.main([*SMALL, *TWO_LEVEL, "--out", str(one)]) == 0
    assert [r["process_index"] for r in res] == [0, 1]
    p0, p1 = res[0]["runs"][0], res[1]["runs"][0]
    assert p0["n_devices"] == p1["n_devices"] == 8
    assert p0["losses"] == p1["losses"] and p0["val_loss"] == p1["val_loss"]
    assert p0["losses"][0] == _losses(one)[0]
    assert p0["losses"] == pytest.approx(_losses(one), rel=1e-6, abs=0)
    assert _losses(two) == p0["losses"]  # process 0 wrote the files, whole
    summary = json.loads((two / "summary.json").read_text())
    assert summary["devices"] == "8 cpu devices (simulated, 2 processes)"
    for i in range(2):  # --process-logs: every process logs its steps to its own file
        text = (tmp_path / "logs" / f"process_00{i}.log").read_text()
        assert f" p{i} " in text and "step 3 loss" in text

    # the two-level run reports its bytes per mesh axis, and its config names the levels
    summary = json.loads((one / "summary.json").read_text())
    config = json.loads((one / "config.json").read_text())
    assert summary["mesh"] == {"node": 2, "local": 4} and config["mesh"] == {"node": 2, "local": 4}
    assert config["qsdp"]["node_axis"] == "node" and config["qsdp"]["inter_grad_bits"] == 4
    by_axis = summary["wire_bytes_by_axis"]
    assert by_axis["node"] > 0 and by_axis["local"] > 0
    assert sum(by_axis.values()) == pytest.approx(summary["wire_bytes_per_step"])


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "rack=2,local=4"], "unknown outer axis 'rack'"),
    (["--mesh", "node=3,local=4"], "do not factor into node x local = 3 x 4"),
    (["--mesh", "node,local"], "give the sizes with one process"),
    (["--mesh", "node=2,local=x"], "must be a positive integer"),
    (["--inter-grad-bits", "4"], "inter_grad_bits=4 is invalid: must be None on a 1-D mesh"),
    (["--mesh", "replica=2,fsdp=4", "--inter-weight-bits", "4"], "inter_weight_bits"),
    (["--num-processes", "2", "--process-id", "0"], "needs a coordinator"),
])
def test_bad_mesh_and_cluster_flags(flags, message, tmp_path, capsys, monkeypatch):
    for var in ("QSDP_COORDINATOR", "SLURM_JOB_ID", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "never"
    assert tg.main([*SMALL, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err, err
    assert not out.exists()


def test_a_process_draws_only_its_rows():
    """BatchSampler.batch(step, rows=...) is the same rows of the full batch (so each process
    can draw just its own part and the global batch stays a function of (seed, step))."""
    import numpy as np

    from experiments.data import BatchSampler

    s = BatchSampler(np.arange(5000) % 256, batch_size=8, seq_len=16, seed=3)
    full = s.batch(7)
    for rows in (slice(0, 4), slice(4, 8), slice(2, 3)):
        part = s.batch(7, rows=rows)
        for k in ("inputs", "targets"):
            np.testing.assert_array_equal(part[k], full[k][rows])
