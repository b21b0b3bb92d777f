"""Worker for tests/test_stop_vote.py, run in each process by experiments.shelf.multiproc: a
loop of steps kept in step by a device collective (as a training step's collectives keep the
processes in step), each process asking to stop after its own step, or never."""

import jax
from jax.experimental import multihost_utils

from qsdp_jax import distributed


def loop(requests: dict[str, int], steps: int = 12) -> dict:
    """Steps 1..``steps``; process ``i`` asks to stop (``"SIGTERM"``) from step ``requests[str(i)]``
    on. Where each process stopped and why."""
    me = jax.process_index()
    ask_from = requests.get(str(me))
    vote = distributed.StopVote()
    for step in range(1, steps + 1):
        multihost_utils.sync_global_devices(f"stop-vote-step-{step}")  # the step's collectives
        request = "SIGTERM" if ask_from is not None and step >= ask_from else None
        why = vote.check(step, request)
        if why is not None:
            return {"process_index": me, "stopped_after": step, "why": why}
    return {"process_index": me, "stopped_after": None, "why": None}


def loops(scenarios: list[dict[str, int]], steps: int = 12) -> dict:
    """:func:`loop` for each of ``scenarios`` in turn (one vote each, as one training loop each)."""
    return {"process_index": jax.process_index(), "runs": [loop(r, steps) for r in scenarios]}
