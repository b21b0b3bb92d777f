"""A multi-process trainer run that succeeds leaves nothing running: ``python -m
experiments.gpt.train`` stops ``jax.distributed`` and process 0's coordination-service helper
when it exits 0, so the coordinator's port is free at once for the next run (the helper used to
hold it for the heartbeat timeout + 10 s, 20 s here). 2 processes x 4 simulated CPU devices."""

from __future__ import annotations

import socket

from experiments.shelf.multiproc import find_free_port
from tests.cluster_procs import read_log, start_trainers, wait_all, wait_for


def _nothing_listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return False
    except OSError:
        return True


def test_a_finished_run_frees_the_coordinator_port_at_once(tmp_path):
    port = find_free_port()
    argv = ["--out", str(tmp_path / "run"), "--peer-timeout", "10"]
    codes = wait_all(start_trainers(tmp_path, [argv, argv], port=port), 240)
    assert codes == [0, 0], read_log(tmp_path, 0)[-3000:] + read_log(tmp_path, 1)[-3000:]
    wait_for(lambda: _nothing_listens(port), 3.0)
    for k in (0, 1):
        assert "did not shut down cleanly" not in read_log(tmp_path, k)
