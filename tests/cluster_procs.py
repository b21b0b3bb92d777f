"""Launching ``python -m experiments.gpt.train`` processes of one multi-process run (2 x 4
simulated CPU devices by default) for tests/test_cluster_agreement.py and
tests/test_cluster_failures.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from experiments.shelf.multiproc import find_free_port
from tests.trainer_flags import trainer_flags

REPO = Path(__file__).resolve().parent.parent
SMALL = trainer_flags(d_model=32, seq_len=32, batch=8, steps=3, no_fp32_ratio=True, quiet=True, simulate_devices=4)


def start_trainers(
    tmp_path: Path,
    extra: list[list[str]],
    *,
    port: int | None = None,
    ids=(0, 1),
    num_processes: int = 2,
    env=None,
    tag: str = "p",
) -> list[subprocess.Popen]:
    """One trainer process per entry of ``ids`` (its ``--process-id``), with ``extra[k]`` added to
    its flags; stdout+stderr to ``tmp_path/<tag><k>.log``. Each is the leader of a process group
    of its own, as the tasks of a scheduler's job are (``os.killpg(p.pid, ...)`` signals it and
    whatever it started in its group)."""
    port = port or find_free_port()
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full_env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", **(env or {}))
    procs = []
    for k, (pid, flags) in enumerate(zip(ids, extra)):
        log = open(tmp_path / f"{tag}{k}.log", "w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "experiments.gpt.train",
                    *SMALL,
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    str(num_processes),
                    "--process-id",
                    str(pid),
                    *flags,
                ],
                cwd=REPO,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def wait_all(procs, timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the process and anything left in its group
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()
    return codes


def read_log(tmp_path: Path, k: int, tag: str = "p") -> str:
    return (tmp_path / f"{tag}{k}.log").read_text(errors="replace")


def wait_for(predicate, timeout_s: float, procs=()) -> None:
    """Poll ``predicate`` until true; AssertionError after ``timeout_s`` or when one of ``procs``
    exits first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"a process exited early with status {p.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


PORT_TAKEN = "choose another port"  # the trainer's message when its coordinator port is taken


def run_trainers(tmp_path: Path, extra: list[list[str]], timeout_s: float, tries: int = 3, **kw) -> list[int | None]:
    """:func:`start_trainers` then :func:`wait_all`, on a fresh port again (up to ``tries``) when
    process 0 found its port taken: ``find_free_port`` cannot reserve it, and another test's
    processes took one between the check and the bind under ``pytest -n 2``."""
    for _ in range(tries - 1):
        procs = start_trainers(tmp_path, extra, **kw)
        try:
            procs[0].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        if procs[0].poll() is None or PORT_TAKEN not in (tmp_path / f"{kw.get('tag', 'p')}0.log").read_text():
            return wait_all(procs, timeout_s)
        wait_all(procs, 0.1)  # process 0 lost the port: end the others, try another
    return wait_all(start_trainers(tmp_path, extra, **kw), timeout_s)
