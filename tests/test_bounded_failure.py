"""Bounded failure: in a 2-process run (gloo), one process SIGKILLed -> the other exits within
the watchdog's bound with a clear message after trying to save; restarted, the run resumes from
its last complete checkpoint and finishes with the uninterrupted run's losses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.shelf.multiproc import find_free_port
from qsdp_jax.checkpoint import Checkpointer
from qsdp_jax.watchdog import StepWatchdog

REPO = Path(__file__).resolve().parent.parent
STEPS, BOUND, SAVE_TIMEOUT = 60, 8.0, 3.0  # the kill lands at step 12 or so; the restart runs the rest


def _launch(out: Path, tag: str) -> list[subprocess.Popen]:
    port = find_free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(out.parent / "jax-cache"),  # the restart reuses it
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    procs = []
    for i in range(2):
        log = open(out.parent / f"{tag}-{i}.log", "w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "experiments.shelf.failure_workload",
                    "--process-id",
                    str(i),
                    "--port",
                    str(port),
                    "--out",
                    str(out),
                    "--steps",
                    str(STEPS),
                    "--every",
                    "5",
                    "--bound",
                    str(BOUND),
                    "--save-timeout",
                    str(SAVE_TIMEOUT),
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _log(out: Path, tag: str, i: int) -> str:
    return (out.parent / f"{tag}-{i}.log").read_text()


def _steps(text: str) -> dict[int, float]:
    return {
        int(w[1]): float(w[2]) for w in (line.split() for line in text.splitlines()) if len(w) == 3 and w[0] == "STEP"
    }


@pytest.mark.slow
def test_peer_killed_survivor_exits_within_bound_and_run_resumes(tmp_path):
    out = tmp_path / "run"
    procs = _launch(out, "first")
    deadline = time.monotonic() + 300
    while len(_steps(_log(out, "first", 1))) < 12 and time.monotonic() < deadline:
        assert procs[1].poll() is None, _log(out, "first", 1)
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    code = procs[0].wait(timeout=BOUND + SAVE_TIMEOUT + 60)
    waited = time.monotonic() - t_kill
    procs[1].wait(timeout=30)
    text = _log(out, "first", 0)
    print(f"survivor exited {waited:.1f} s after the peer was killed (bound {BOUND:g} s)")
    assert code == 75, text[-3000:]
    assert waited < BOUND + SAVE_TIMEOUT + 10, waited  # the bound, plus step and save allowance
    # either the collective failed at once (gloo saw the connection drop) or no step finished
    # within the bound (the collective blocked): both say so
    assert (
        "watchdog: process 0 of 2 finished no train step for 8 s" in text
        or "watchdog: process 0 of 2 a collective failed (JaxRuntimeError" in text
    ), text[-3000:]
    assert "another process of the run most likely died or froze" in text
    assert "restart the run to resume" in text
    done_before = max(_steps(text))
    assert done_before < STEPS
    with Checkpointer(out / "checkpoints") as c:
        last = c.latest_step()
    assert last is not None and last <= done_before

    procs = _launch(out, "again")  # restart: both resume from the last complete checkpoint
    for p in procs:
        assert p.wait(timeout=600) == 0, _log(out, "again", 0)[-3000:]
    again = _log(out, "again", 0)
    assert f"RESUMED {last}" in again
    resumed = _steps(again)
    assert sorted(resumed) == list(range(last + 1, STEPS + 1))
    first = _steps(text)
    common = [s for s in resumed if s in first]
    assert common and all(resumed[s] == first[s] for s in common)  # same numbers after resuming


@pytest.mark.slow
def test_peer_frozen_survivor_exits_within_bound(tmp_path):
    """SIGSTOP (a frozen peer: its sockets stay open, no collective fails): the watchdog ends
    the survivor within the bound with the message."""
    out = tmp_path / "run"
    procs = _launch(out, "frozen")
    deadline = time.monotonic() + 300
    while len(_steps(_log(out, "frozen", 1))) < 6 and time.monotonic() < deadline:
        assert procs[1].poll() is None, _log(out, "frozen", 1)
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        code = procs[0].wait(timeout=BOUND + SAVE_TIMEOUT + 60)
        waited = time.monotonic() - t_stop
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=30)
    text = _log(out, "frozen", 0)
    print(f"survivor exited {waited:.1f} s after the peer was frozen (bound {BOUND:g} s)")
    assert code == 75, text[-3000:]
    assert BOUND - 1 < waited < BOUND + SAVE_TIMEOUT + 10, waited
    assert "watchdog: process 0 of 2 finished no train step for 8 s" in text, text[-3000:]
    assert "restart the run to resume" in text


def test_watchdog_fires_once_and_tries_to_save():
    exits, calls = [], []
    dog = StepWatchdog(
        0.3, on_timeout=lambda: calls.append(1) or "saved step 7", save_timeout_s=1.0, _exit=exits.append, what="test"
    )
    time.sleep(0.5)
    assert exits == []  # not armed before the first beat
    dog.beat(7)
    time.sleep(1.0)
    dog.stop()
    assert exits == [75] and calls == [1]
    exits.clear()
    dog = StepWatchdog(60, _exit=exits.append)
    dog.fail(RuntimeError("Connection reset by peer"))
    assert exits == [75]
    with pytest.raises(ValueError, match="timeout_s=0 is invalid"):
        StepWatchdog(0)
