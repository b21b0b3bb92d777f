"""A multi-process trainer run that cannot start, or loses a process, ends every process that is
left within a bound, with a message naming the problem (it used to be 5 minutes of silence, or
JAX's C++ abort, status 134, naming nothing). 2 trainer processes x 4 simulated CPU devices."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from experiments.shelf.multiproc import find_free_port
from tests.cluster_procs import read_log, start_trainers, wait_all, wait_for

WATCHING = "peer monitor: process {} of 2 watches the others"


def _start_watched(tmp_path, flags=()):
    """Two processes whose peer monitors run (setup goes on: compiling, then 3 steps)."""
    logs = tmp_path / "logs"
    argv = ["--out", str(tmp_path / "run"), "--process-logs", str(logs), "--steps", "200", *flags]
    procs = start_trainers(tmp_path, [argv, argv])

    def watching():
        return all(
            f.exists() and WATCHING.format(i) in f.read_text()
            for i, f in enumerate(logs / f"process_00{i}.log" for i in range(2))
        )

    wait_for(watching, 60, procs)
    return procs


@pytest.mark.parametrize(
    "victim, sig, group, message, bound",
    [
        (0, signal.SIGKILL, False, "process 1 of 2 stops: process 0 of 2 (the coordinator) died or was killed", 5.0),
        (0, signal.SIGKILL, True, "process 1 of 2 stops: process 0 of 2 (the coordinator) died or was killed", 5.0),
        (1, signal.SIGSTOP, False, "process 0 of 2 stops: process 1 of 2 sent no heartbeat for 3 s", 3.0 + 5.0),
    ],
    ids=["kill-0", "kill-0s-group", "stop-1"],
)
def test_lost_process_ends_the_survivor_with_a_message(tmp_path, victim, sig, group, message, bound):
    """``kill-0s-group`` is the whole process group of process 0 killed, as a scheduler or an
    out-of-memory killer of the task does: it took the coordination service's helper with it,
    and the survivor ended 134 from C++ with no message in 2 of 3 tries."""
    procs = _start_watched(tmp_path, ["--peer-timeout", "3"])
    survivor = 1 - victim
    if group:
        os.killpg(procs[victim].pid, sig)
    else:
        procs[victim].send_signal(sig)
    t0 = time.monotonic()
    try:
        code = procs[survivor].wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        procs[victim].kill()
        wait_all(procs, 30)
    text = read_log(tmp_path, survivor)
    print(f"{sig.name} to process {victim}: process {survivor} exited {code} after {took:.2f} s")
    assert code == 75, text[-3000:]
    assert message in text, text[-3000:]
    assert "restart the run to resume from its last complete checkpoint" in text
    assert took < bound, took


@pytest.mark.slow
def test_process_killed_while_training_ends_the_other_checkpoints_intact(tmp_path):
    """SIGKILL to process 1 after 6 steps (a checkpoint every 2): process 0 exits at once with
    the message; the latest complete checkpoint is one of the steps done before the kill."""
    from qsdp_jax.checkpoint import Checkpointer

    procs = _start_watched(tmp_path, ["--checkpoint-every", "2", "--eval-every", "200"])
    log1 = tmp_path / "logs" / "process_001.log"
    wait_for(lambda: "step 6 loss" in log1.read_text(), 120, procs)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    code = procs[0].wait(timeout=60)
    took = time.monotonic() - t0
    wait_all(procs, 30)
    text = read_log(tmp_path, 0)
    print(f"SIGKILL to process 1 while training: process 0 exited {code} after {took:.2f} s")
    assert code == 75, text[-3000:]
    assert "process 0 of 2 stops: process 1 of 2 died or was killed" in text, text[-3000:]
    assert took < 5.0, took
    with Checkpointer(tmp_path / "run" / "checkpoints") as c:
        latest = c.latest_step()
    done = max(
        int(line.split(" step ")[1].split()[0])
        for line in log1.read_text().splitlines()
        if " step " in line and " loss " in line
    )
    assert latest is not None and 4 <= latest <= done and latest % 2 == 0, (latest, done)


def test_processes_that_never_meet_fail_within_the_bound_naming_why(tmp_path):
    """Only process 0 started (it waits for process 1), and a process 1 given a port where
    nothing listens: each exits with status 69 after --init-timeout, saying which it is."""
    port0, wrong = find_free_port(), find_free_port()
    flags = ["--init-timeout", "4", "--out", str(tmp_path / "run")]
    alone = start_trainers(tmp_path, [flags], port=port0, ids=(0,))
    (tmp_path / "x").mkdir()
    lost = start_trainers(tmp_path / "x", [flags], port=wrong, ids=(1,))
    t0 = time.monotonic()
    codes = wait_all([*alone, *lost], 60)
    took = time.monotonic() - t0
    text0, text1 = read_log(tmp_path, 0), read_log(tmp_path / "x", 0)
    print(f"exited {codes} {took:.1f} s after starting (init timeout 4 s)")
    assert codes == [69, 69], (text0[-2000:], text1[-2000:])
    assert (
        f"process 0 of 2 (the coordinator, at 127.0.0.1:{port0}) waited 4 s but not all 2 processes connected to it"
    ) in text0, text0[-2000:]
    assert (
        f"process 1 of 2 did not connect to the coordinator 127.0.0.1:{wrong} within 4 s: "
        "nothing accepts connections there"
    ) in text1, text1[-2000:]
    assert "Exiting with status 69." in text0 and "Exiting with status 69." in text1
    for text in (text0, text1):
        assert "Check failure" not in text and "Traceback" not in text, text[-2000:]


def test_a_second_process_0_is_refused_at_once(tmp_path):
    """Two processes started with --process-id 0: the second finds the coordinator's port taken
    and says so (usage error) instead of waiting."""
    port = find_free_port()
    flags = ["--init-timeout", "20", "--out", str(tmp_path / "run")]
    first = start_trainers(tmp_path, [flags], port=port, ids=(0,))
    import socket

    def listening():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(listening, 60, first)
    (tmp_path / "second").mkdir()
    second = start_trainers(tmp_path / "second", [flags], port=port, ids=(0,))
    code = wait_all(second, 60)[0]
    first[0].kill()
    wait_all(first, 10)
    text = read_log(tmp_path / "second", 0)
    assert code == 2, text[-2000:]
    assert f"the coordinator's port {port} (127.0.0.1:{port}) is already in use" in text, text
    assert "do two processes share an id?" in text


def test_sigterm_to_every_process_group_saves_one_step_on_both(tmp_path):
    """A scheduler's stop (SLURM's scancel, preemption, time limit; timeout; systemd) is a
    SIGTERM to each task's process group. Both processes save the same step and exit 143 (before:
    the coordination service's helper, in process 0's group, died of it and JAX aborted both
    trainers from C++, status 134, no checkpoint). The exact resume after such a stop is
    tests/test_trainer_cluster.py::test_two_processes_stop_resume_and_overwrite_checkpoints."""
    from qsdp_jax.checkpoint import Checkpointer

    procs = _start_watched(tmp_path, ["--checkpoint-every", "100", "--eval-every", "200"])
    logs = [tmp_path / "logs" / f"process_00{i}.log" for i in range(2)]
    wait_for(lambda: all("step 3 loss" in f.read_text() for f in logs), 120, procs)
    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
    codes = wait_all(procs, 120)
    texts = [read_log(tmp_path, i) for i in range(2)]
    assert codes == [143, 143], [t[-2000:] for t in texts]
    saved = [re.findall(r"SIGTERM(?: to process \d)? at step (\d+)/200: saved checkpoint", t) for t in texts]
    assert len(saved[0]) == 1 and saved[0] == saved[1], saved
    with Checkpointer(tmp_path / "run" / "checkpoints") as c:
        assert c.latest_step() == int(saved[0][0]) < 200
    for t in texts:
        assert "Terminating process because" not in t and "Check failure" not in t, t[-2000:]
