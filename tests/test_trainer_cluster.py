"""The trainer on several processes and on 2-D meshes: 2 processes x 4 CPU devices (gloo,
localhost) train to the same losses as 1 process x 8 devices; mesh and per-level-bits flags;
bad mesh input gives a usage error."""

import json
from pathlib import Path

import pytest

from experiments.gpt import train as tg
from experiments.shelf.multiproc import run_processes
from tests.test_export import u8_collectives
from tests.trainer_flags import DATA, trainer_flags

SMALL = trainer_flags(
    d_model=32, n_layers=2, seq_len=32, batch=8, steps=3, eval_every=3, no_fp32_ratio=True, quiet=True
)


def _losses(out: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]


TWO_LEVEL = ["--weight-bits", "8", "--grad-bits", "8", "--mesh", "node=2,local=4", "--inter-grad-bits", "4"]


@pytest.mark.optimized  # step 1 bitwise holds with XLA's defaults, not at the suite's O0 (1e-7 off)
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
    res = run_processes(
        "tests.trainer_worker",
        "train",
        num_processes=2,
        devices_per_process=4,
        kwargs={"argvs": [[*SMALL, *TWO_LEVEL, "--out", str(two), "--process-logs", str(tmp_path / "logs")]]},
        timeout_s=300,
    )
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


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mesh", "rack=2,local=4"], "unknown outer axis 'rack'"),
        (["--mesh", "node=3,local=4"], "do not factor into node x local = 3 x 4"),
        (["--mesh", "node,local"], "give the sizes with one process"),
        (["--mesh", "node=2,local=x"], "must be a positive integer"),
        (["--inter-grad-bits", "4"], "inter_grad_bits=4 is invalid: must be None on a 1-D mesh"),
        (["--mesh", "replica=2,fsdp=4", "--inter-weight-bits", "4"], "inter_weight_bits"),
        (["--num-processes", "2", "--process-id", "0"], "needs a coordinator"),
    ],
)
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

    from experiments.gpt.data import BatchSampler

    s = BatchSampler(np.arange(5000) % 256, batch_size=8, seq_len=16, seed=3)
    full = s.batch(7)
    for rows in (slice(0, 4), slice(4, 8), slice(2, 3)):
        part = s.batch(7, rows=rows)
        for k in ("inputs", "targets"):
            np.testing.assert_array_equal(part[k], full[k][rows])


def test_two_level_trainer_step_exports_for_tpu_and_cuda():
    """The trainer's step (the NNX front door) on a ("node", "local") mesh, QSDP W8G8 with 4-bit
    gradients across nodes, lowers for hardware this machine does not have, with packed uint8
    collectives in it."""
    import jax

    import qsdp_jax as q
    from experiments.gpt.trainer import RunConfig, Trainer

    cfg = q.QSDPConfig.qsdp(
        8, 8, bucket_size=64, inter_grad_bits=4, node_axis="node", axis_name="local", min_shard_size=512
    )
    run = RunConfig(
        qsdp=cfg,
        preset="tiny",
        seq_len=32,
        steps=2,
        batch_size=8,
        model_overrides=(("d_model", 32), ("n_heads", 2), ("n_layers", 2)),
        data_path=str(DATA),
        eval_batches=1,
        mesh=(("node", 2), ("local", 4)),
    )
    trainer = Trainer(run)
    batch = trainer.batch(0)
    for platform in ("tpu", "cuda"):
        exported = jax.export.export(trainer.step_fn, platforms=[platform])(trainer.state, batch)
        assert exported.platforms == (platform,)
        ops = u8_collectives(trainer.mesh, exported.mlir_module(), platform=platform)
        inter, intra = "[[0, 4], [1, 5], [2, 6], [3, 7]]", "[[0, 1, 2, 3], [4, 5, 6, 7]]"
        for kind in ("all_to_all", "all_gather"):  # gradients, weights: packed u8 at both levels
            assert (kind, inter) in ops and (kind, intra) in ops, (kind, ops)


def test_two_processes_stop_resume_and_overwrite_checkpoints(tmp_path):
    """2 processes x 4 devices, checkpoints on a shared directory: a run stopped by SIGTERM to
    process 1's group after step 3 and to process 0's after step 4 stops after step 4 on both
    and saves it (every process takes part in orbax's save), --resume continues it to the losses
    of a straight run bit for bit, and a fresh --overwrite run over the same directory (process 0
    alone moves the old checkpoints aside and deletes them, the others wait at a barrier) trains
    to the same losses and leaves only its own checkpoints."""
    from qsdp_jax.checkpoint import Checkpointer

    argv = [
        *trainer_flags(d_model=32, n_layers=2, seq_len=32, batch=8),
        "--steps",
        "6",
        "--eval-every",
        "6",
        "--no-fp32-ratio",
        "--quiet",
        "--weight-bits",
        "8",
        "--grad-bits",
        "8",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--keep",
        "2",
    ]
    straight, out = tmp_path / "straight", tmp_path / "ckpt"
    cache = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }  # later runs skip compiling
    res = run_processes(
        "tests.trainer_worker",
        "stop_resume_overwrite",
        num_processes=2,
        devices_per_process=4,
        timeout_s=400,
        extra_env=cache,
        kwargs={"argv": argv, "straight": str(straight), "out": str(out), "stop_at": {"0": 4, "1": 3}},
    )
    assert [r["process_index"] for r in res] == [0, 1]
    stops = [r["stopped"] for r in res]
    assert stops[0] is not None and stops[0].startswith("SIGTERM to process 1 at step 4/6: saved"), stops
    assert stops[1] is not None and stops[1].startswith("SIGTERM at step 4/6: saved"), stops
    for r in res:
        assert len(r["straight"]) == 6
        assert r["resumed"] == r["straight"] and r["overwritten"] == r["straight"]
    assert _losses(out) == _losses(straight) == res[0]["straight"]
    with Checkpointer(out / "checkpoints") as c:
        assert c.all_steps() == [4, 6]  # the overwriting run's own last 2
    assert not (out / "checkpoints.replaced").exists()
