"""The launchers under gpu_scripts/ and tpu_scripts/: every *.sh parses (bash -n), passes
shellcheck when it is installed, and prints its commands with --dry-run without running any;
the dry-run output of each launcher says what it would do."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("gpu_scripts", "tpu_scripts") for p in (REPO / d).glob("*.sh"))
LIB = REPO / "scripts_lib.sh"  # sourced by the launchers: show, gpu_overlap_env, device_check_main
ACTIONS = ("srun", "sbatch", "gcloud", "python", "python3", "pip", "docker", "git")


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH where every command that would act (srun, gcloud, python...) only leaves a mark."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marks = tmp_path / "ran.txt"
    for name in ACTIONS:
        f = bin_dir / name
        f.write_text(f'#!/bin/bash\necho "{name} $*" >> {marks}\nexit 1\n')
        f.chmod(0o755)
    return bin_dir, marks


def _dry_run(script: Path, fake_bin, *args, env=None, retry_with=None) -> str:
    """``bash script --dry-run *args``; when that is a usage error (exit 2) and ``retry_with``
    is given, once more with it appended (scripts that need an argument, e.g. an output folder)."""
    bin_dir, marks = fake_bin
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "QSDP_", "TPU_", "NUM_GPUS", "PROCS", "MESH"))
    }
    full_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python"), **(env or {}))
    cmd = ["bash", str(script), "--dry-run", *args]
    r = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=60)
    if r.returncode == 2 and retry_with is not None:
        r = subprocess.run([*cmd, retry_with], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not marks.exists(), f"--dry-run ran: {marks.read_text()}"
    return r.stdout


def test_there_are_launchers():
    names = {p.name for p in SCRIPTS}
    assert {"slurm_train.sh", "single_node.sh", "pod.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_script_parses_and_has_a_usage_header(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    head = script.read_text().splitlines()[:20]
    assert head[0].startswith("#!") and sum(line.startswith("#") for line in head) >= 5
    rel = str(script.relative_to(REPO))
    assert any(line.startswith("#") and rel in line for line in head), (
        f"the header says how to run it (a line with {rel})"
    )


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", SCRIPTS + [LIB], ids=_ids(SCRIPTS + [LIB]))
def test_shellcheck(script):
    # -x -P SCRIPTDIR/..: follow the scripts_lib.sh they source (its own warnings: the LIB case)
    r = subprocess.run(
        ["shellcheck", "-x", "-P", "SCRIPTDIR/..", "-S", "warning", str(script)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_dry_run_prints_and_runs_nothing(script, fake_bin, tmp_path):
    out_dir = tmp_path / "out"
    assert _dry_run(script, fake_bin, retry_with=str(out_dir)).strip()
    assert not out_dir.exists() or not any(out_dir.iterdir())  # nothing written either


def test_slurm_dry_run(fake_bin):
    script = REPO / "gpu_scripts" / "slurm_train.sh"
    out = _dry_run(
        script,
        fake_bin,
        "--preset",
        "small",
        "--inter-grad-bits",
        "4",
        env={"SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "77", "GPUS_PER_NODE": "8"},
    )
    srun = [line for line in out.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    assert "--nodes=4 --ntasks-per-node=8" in srun[0]  # one process per GPU
    assert "-m experiments.gpt.train --mesh node=4,local=8 --out runs/slurm-77" in srun[0]
    assert srun[0].endswith("--preset small --inter-grad-bits 4")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out
    assert "pipelined" not in out  # the train step sets XLA's collective pipelining itself
    assert "QSDP_HEARTBEAT_TIMEOUT_S=10" in out and "NCCL_DEBUG=WARN" in out
    per_node = _dry_run(script, fake_bin, env={"SLURM_JOB_NUM_NODES": "2", "PROCS": "node", "GPUS_PER_NODE": "4"})
    assert "export JAX_LOCAL_DEVICE_IDS=0,1,2,3" in per_node  # a node's process drives all GPUs
    assert "--ntasks-per-node=1" in per_node and "--mesh node=2,local=4" in per_node


def test_single_node_dry_run(fake_bin):
    script = REPO / "gpu_scripts" / "single_node.sh"
    one = _dry_run(script, fake_bin, "--steps", "5", env={"NUM_GPUS": "4"})
    assert "-m experiments.gpt.train --devices 4 --out runs/single-node --steps 5" in one
    per_gpu = _dry_run(script, fake_bin, env={"NUM_GPUS": "2", "PROCS": "gpu"})
    lines = [line for line in per_gpu.splitlines() if line.startswith("env ")]
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert (
            f"QSDP_COORDINATOR=127.0.0.1:29511 QSDP_NUM_PROCESSES=2 QSDP_PROCESS_ID={i} QSDP_LOCAL_DEVICE_IDS={i}"
        ) in line


def test_tpu_pod_dry_run(fake_bin):
    script = REPO / "tpu_scripts" / "pod.sh"
    out = _dry_run(
        script,
        fake_bin,
        "all",
        "--preset",
        "small",
        env={"TPU_NAME": "t1", "ZONE": "z1", "ACCELERATOR_TYPE": "v5p-16", "NUM_WORKERS": "2"},
    )
    lines = out.splitlines()
    create = next(i for i, l in enumerate(lines) if " tpu-vm create t1" in l)
    install = next(i for i, l in enumerate(lines) if "pip install" in l)
    train = next(i for i, l in enumerate(lines) if "experiments.gpt.train" in l)
    logs = [i for i, l in enumerate(lines) if "train.log" in l and " scp " in l]
    delete = next(i for i, l in enumerate(lines) if " tpu-vm delete t1" in l)
    assert create < install < train < min(logs) < delete and len(logs) == 2
    assert "--accelerator-type=v5p-16" in lines[create] and "--zone=z1" in lines[create]
    assert "--worker=all" in lines[install] and "--worker=all" in lines[train]
    assert "--mesh node,local" in lines[train] and "--preset small" in lines[train]
    kept = _dry_run(script, fake_bin, "all", env={"KEEP": "1", "NUM_WORKERS": "1"})
    assert " tpu-vm delete " not in kept
    only = _dry_run(script, fake_bin, "delete", env={"TPU_NAME": "t2"})
    assert only.strip().splitlines() == ["gcloud compute tpus tpu-vm delete t2 --zone=us-central2-b --quiet"]


def test_bad_step_is_refused(fake_bin):
    bin_dir, marks = fake_bin
    r = subprocess.run(
        ["bash", str(REPO / "tpu_scripts" / "pod.sh"), "launch"],
        cwd=REPO,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unknown step 'launch'" in r.stderr and not marks.exists()
