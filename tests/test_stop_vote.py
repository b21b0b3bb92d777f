"""StopVote: the processes of a run stop after the same step when any of them is asked to (a
scheduler's SIGTERM reaches them at different moments), so that all save the same checkpoint."""

from __future__ import annotations

import pytest

from experiments.shelf.multiproc import run_processes
from qsdp_jax import distributed


def test_one_process_stops_after_the_step_it_was_asked_in():
    vote = distributed.StopVote()
    assert vote.check(1) is None and vote.check(2) is None
    assert vote.check(3, "SIGTERM") == "SIGTERM"
    assert vote.check(4) == "SIGTERM"  # a decision stays


@pytest.mark.parametrize(
    "requests, after, why",
    [
        ({"1": 3}, 4, ["SIGTERM to process 1", "SIGTERM"]),  # one process only: both stop
        ({"0": 5, "1": 3}, 4, ["SIGTERM to process 1", "SIGTERM"]),  # the first request stands
        ({"0": 2, "1": 2}, 3, None),  # asked in the same step: one of the two requests
    ],
    ids=["one-asks", "first-stands", "both-at-once"],
)
def test_processes_stop_after_the_same_step(requests, after, why):
    res = run_processes("tests.stop_vote_worker", "loop", num_processes=2, kwargs={"requests": requests}, timeout_s=120)
    assert [r["process_index"] for r in res] == [0, 1]
    assert [r["stopped_after"] for r in res] == [after, after], res
    if why is not None:
        assert [r["why"] for r in res] == why
    else:
        assert {r["why"] for r in res} in ({"SIGTERM", "SIGTERM to process 1"}, {"SIGTERM", "SIGTERM to process 0"})


def test_no_request_no_stop():
    res = run_processes("tests.stop_vote_worker", "loop", num_processes=2, kwargs={"requests": {}}, timeout_s=120)
    assert [r["stopped_after"] for r in res] == [None, None]
