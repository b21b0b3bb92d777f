"""qsdp_jax.distributed: settings from the environment, clear errors, cluster detection, the
single-process no-op, and a real 2-process start from QSDP_* variables (gloo, localhost)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from experiments.shelf.multiproc import find_free_port
from qsdp_jax import distributed
from qsdp_jax.distributed import DistributedInfo, DistributedSettings
from tests.process_env import CLUSTER_VARS, process_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    """No QSDP_*, cluster or coordinator variables; a fresh idempotence state."""
    for var in list(os.environ):
        if var.startswith("QSDP_") or var in CLUSTER_VARS:
            monkeypatch.delenv(var)
    monkeypatch.setitem(distributed._STATE, "info", None)
    return monkeypatch


def test_settings_from_env_and_overrides():
    env = {
        "QSDP_COORDINATOR": "10.0.0.1:1234",
        "QSDP_NUM_PROCESSES": "4",
        "QSDP_PROCESS_ID": "3",
        "QSDP_LOCAL_DEVICE_IDS": "0,1",
        "QSDP_HEARTBEAT_TIMEOUT_S": "7",
    }
    s = DistributedSettings.from_env(env)
    assert (s.coordinator, s.num_processes, s.process_id) == ("10.0.0.1:1234", 4, 3)
    assert s.local_device_ids == (0, 1) and s.heartbeat_timeout_s == 7
    assert DistributedSettings.from_env(env, process_id=2, coordinator=None).process_id == 2
    # short heartbeat by default: a dead peer must not freeze the others for jax's 100 s
    assert DistributedSettings().heartbeat_timeout_s <= 30
    assert DistributedSettings.from_env({"JAX_COORDINATOR_ADDRESS": "h:1"}).coordinator == "h:1"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(coordinator="nohostport"), ["coordinator", "nohostport", "host:port"]),
        (dict(num_processes=0), ["num_processes", "0", ">= 1"]),
        (dict(num_processes=2, process_id=2), ["process_id", "2", "num_processes=2"]),
        (dict(local_device_ids=()), ["local_device_ids"]),
        (dict(heartbeat_timeout_s=0), ["heartbeat_timeout_s", ">= 1"]),
    ],
)
def test_bad_settings_name_the_field(kwargs, words):
    with pytest.raises(ValueError) as e:
        DistributedSettings(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="QSDP_NUM_PROCESSES='two'"):
        DistributedSettings.from_env({"QSDP_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match="QSDP_LOCAL_DEVICE_IDS"):
        DistributedSettings.from_env({"QSDP_LOCAL_DEVICE_IDS": "0;1"})


def test_missing_coordinator_is_a_clear_error(clean_env):
    with pytest.raises(ValueError, match="needs a coordinator.*QSDP_COORDINATOR"):
        distributed.resolve(DistributedSettings(num_processes=2, process_id=0))
    with pytest.raises(ValueError, match="QSDP_PROCESS_ID"):
        distributed.resolve(DistributedSettings(coordinator="h:1", num_processes=2))
    clean_env.setenv("QSDP_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="coordinator"):
        distributed.initialize()  # refused before anything starts
    assert not jax.distributed.is_initialized()


def test_resolve_single_explicit_and_slurm(clean_env):
    assert distributed.resolve() == DistributedInfo("single", 1, 0)
    s = DistributedSettings(coordinator="h:9", num_processes=2, process_id=1)
    assert distributed.resolve(s) == DistributedInfo("explicit", 2, 1, "h:9")
    # SLURM through JAX's own detection (srun sets these in every task)
    for k, v in {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "gpu[007-008]",
        "SLURM_NTASKS": "16",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
    }.items():
        clean_env.setenv(k, v)
    assert distributed.detect_cluster() == "slurm"
    info = distributed.resolve()
    assert (info.source, info.num_processes) == ("slurm", 16) and info.is_multi_process
    # a cluster fills in what the explicit settings leave out (here: the coordinator)
    assert distributed.resolve(DistributedSettings(num_processes=16, process_id=9)).source == "slurm"
    assert distributed.resolve(DistributedSettings(cluster_detection="deactivate")).source == "single"
    clean_env.setenv("SLURM_NTASKS", "1")
    clean_env.setitem(distributed._STATE, "info", None)
    assert distributed.initialize().source == "single"  # a 1-task allocation starts nothing


def test_single_process_is_a_noop_and_idempotent(clean_env, tmp_path, capsys):
    info = distributed.initialize()
    assert info == DistributedInfo("single", 1, 0)
    assert distributed.initialize() == info
    assert not jax.distributed.is_initialized()
    assert distributed.is_main_process() and distributed.num_processes() == 1
    path = distributed.enable_process_log(tmp_path)
    distributed.main_print("progress", 3)
    assert capsys.readouterr().out == "progress 3\n"
    assert path.name == "process_000.log" and "progress 3" in path.read_text()


def test_multi_process_after_jax_started_is_refused(clean_env):
    jax.devices()  # backends exist now, as in this test session
    with pytest.raises(RuntimeError, match="before any other JAX call"):
        distributed.initialize(coordinator="127.0.0.1:1", num_processes=2, process_id=0)


def test_two_processes_start_from_env(tmp_path):
    """Two real processes, 4 CPU devices each, started only by QSDP_* variables."""
    port = find_free_port()
    env = process_env(port, 4, num_processes="2", heartbeat_timeout_s="5", init_timeout_s="60")
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "distributed_worker.py"), str(tmp_path)],
            env={**env, "QSDP_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(REPO),
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    for i, r in enumerate(res):
        assert (r["source"], r["num_processes"], r["process_id"]) == ("explicit", 2, i)
        assert r["same"] and r["process_count"] == 2
        assert r["device_count"] == 8 and r["local_device_count"] == 4
        assert r["gathered"] == [1.0, 2.0]
        assert r["is_main"] == (i == 0)
        assert Path(r["log_path"]).name == f"process_00{i}.log"
        assert "hello from the main process" in Path(r["log_path"]).read_text()
        assert r["helper_exit"] == (0 if i == 0 else None)  # process 0's service helper stopped
    # only process 0 prints progress
    assert "hello from the main process" in outs[0]
    assert "hello from the main process" not in outs[1]


def test_importing_the_package_starts_no_backend():
    """jax.distributed must start before JAX's backends: importing qsdp_jax may not create them
    (a module-level jnp constant would, and then every multi-process start fails)."""
    code = (
        "import qsdp_jax, experiments.gpt.train, experiments.gpt.trainer\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized(), 'a backend was started at import'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
