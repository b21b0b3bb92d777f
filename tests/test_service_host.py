"""Process 0 hosts JAX's coordination service in a helper process that outlives it: its death
reaches the others as missed heartbeats (after the heartbeat timeout), not as JAX's C++ abort at
the same moment, so the peer monitor's message and status 75 come first by construction.
Two real processes with 1 simulated CPU device each, started by QSDP_* variables."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.shelf.multiproc import find_free_port
from qsdp_jax import distributed
from qsdp_jax._src.distributed.service_host import ServiceHost
from tests.process_env import REPO, process_env

HEARTBEAT_S = 3
# the library's own start, no peer monitor: what is left is JAX's reaction to process 0's death
IDLE = """
import time
from qsdp_jax import distributed
distributed.initialize()
host = distributed._HOST["host"]
print("up", host.proc.pid if host else -1, flush=True)
while True:
    time.sleep(0.05)
"""


def _start_pair(tmp_path: Path, helper: bool) -> list[subprocess.Popen]:
    port = find_free_port()
    env = process_env(
        port,
        1,
        num_processes="2",
        heartbeat_timeout_s=str(HEARTBEAT_S),
        init_timeout_s="60",
        service_helper="1" if helper else "0",
    )
    return [
        subprocess.Popen(
            [sys.executable, "-c", IDLE],
            env={**env, "QSDP_PROCESS_ID": str(i)},
            stdout=open(tmp_path / f"p{i}.log", "w"),
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
        )
        for i in range(2)
    ]


def _wait_up(tmp_path: Path, procs) -> int:
    """Wait until both processes are connected; the helper's pid (-1: none)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        lines = [(tmp_path / f"p{i}.log").read_text().splitlines() for i in range(2)]
        ups = [[w for w in ls if w.startswith("up ")] for ls in lines]
        if all(ups):
            return int(ups[0][0].split()[1])
        assert all(p.poll() is None for p in procs), "\n".join("\n".join(ls[-20:]) for ls in lines)
        time.sleep(0.1)
    raise AssertionError("the two processes did not connect within 90 s")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited (an orphan may wait for its reaper)


@pytest.mark.parametrize("helper", [True, False], ids=["helper", "in-process-0"])
def test_process_0_killed_reaches_the_other_after_the_heartbeat_timeout(tmp_path, helper):
    """With the helper, the survivor's JAX client lives on for the heartbeat timeout after
    process 0's SIGKILL (the peer monitor's window), then JAX ends it; the helper goes
    ``heartbeat + 10`` s later. Without it (jax's arrangement), JAX aborts the survivor at once."""
    procs = _start_pair(tmp_path, helper)
    try:
        helper_pid = _wait_up(tmp_path, procs)
        assert (helper_pid > 0) == helper
        procs[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        procs[0].wait(timeout=30)
        while procs[1].poll() is None and time.monotonic() - t0 < 2.0:
            time.sleep(0.05)
        lived = time.monotonic() - t0
        log = (tmp_path / "p1.log").read_text()[-3000:]
        if not helper:
            assert procs[1].poll() not in (None, 0) and lived < 2.0, (lived, log)
            return
        assert procs[1].poll() is None, f"the survivor ended {lived:.2f} s after process 0's death:\n{log}"
        code = procs[1].wait(timeout=HEARTBEAT_S + 30)
        assert code != 0, log
        while _alive(helper_pid) and time.monotonic() - t0 < HEARTBEAT_S + 10 + 20:
            time.sleep(0.2)
        assert not _alive(helper_pid), "the helper outlived its linger"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_helper_that_cannot_listen_is_an_error_naming_the_switch():
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as taken:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"did not start on \[::\]:\d+.*service_helper=False"):
            ServiceHost.start(f"[::]:{port}", 2, heartbeat_timeout_s=3, shutdown_timeout_s=3, linger_s=1)
        assert time.monotonic() - t0 < 30  # the helper's exit ends the wait, not the timeout


def test_the_switch_is_validated_and_read_from_the_environment():
    assert distributed.DistributedSettings().service_helper is True
    assert distributed.DistributedSettings.from_env({"QSDP_SERVICE_HELPER": "0"}).service_helper is False
    assert distributed.DistributedSettings.from_env({"QSDP_SERVICE_HELPER": "true"}).service_helper is True
    with pytest.raises(ValueError, match="QSDP_SERVICE_HELPER='maybe' is invalid: must be 1 or 0"):
        distributed.DistributedSettings.from_env({"QSDP_SERVICE_HELPER": "maybe"})
    with pytest.raises(ValueError, match="DistributedSettings.service_helper='yes' is invalid: must be True or False"):
        distributed.DistributedSettings(service_helper="yes")  # type: ignore[arg-type]


def test_the_helper_is_out_of_process_0s_group_and_ignores_stop_signals():
    """A scheduler's SIGTERM (or SIGINT, SIGHUP) to process 0's group misses the helper, and one
    sent to it directly is ignored: the service stays up while the trainers save. ``stop``
    still ends it."""
    port = find_free_port()
    host = ServiceHost.start(f"[::]:{port}", 2, heartbeat_timeout_s=3, shutdown_timeout_s=3, linger_s=1)
    try:
        pid = host.proc.pid
        assert os.getpgid(pid) != os.getpgid(0) and os.getsid(pid) != os.getsid(0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(pid, sig)
        time.sleep(0.5)
        assert host.proc.poll() is None, "a stop signal ended the helper"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the service still listens
        t0 = time.monotonic()
        host.stop()
        assert host.proc.returncode == 0 and time.monotonic() - t0 < 5
    finally:
        if host.proc.poll() is None:
            host.proc.kill()
            host.proc.wait()
