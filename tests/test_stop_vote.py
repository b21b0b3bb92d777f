"""StopVote: the processes of a run stop after the same step when any of them is asked to (a
scheduler's SIGTERM reaches them at different moments), so that all save the same checkpoint."""

from __future__ import annotations


from experiments.shelf.multiproc import run_processes
from qsdp_jax import distributed


def test_one_process_stops_after_the_step_it_was_asked_in():
    vote = distributed.StopVote()
    assert vote.check(1) is None and vote.check(2) is None
    assert vote.check(3, "SIGTERM") == "SIGTERM"
    assert vote.check(4) == "SIGTERM"  # a decision stays


SCENARIOS = [  # (requests by process, the step both stop after, the reasons)
    ({"1": 3}, 4, ["SIGTERM to process 1", "SIGTERM"]),  # one process only: both stop
    ({"0": 5, "1": 3}, 4, ["SIGTERM to process 1", "SIGTERM"]),  # the first request stands
    ({"0": 2, "1": 2}, 3, None),  # asked in the same step: one of the two requests
    ({}, None, [None, None]),  # no request: no stop
]


def test_processes_stop_after_the_same_step():
    """The scenarios one after the other in one pair of processes (a vote per loop)."""
    res = run_processes(
        "tests.stop_vote_worker",
        "loops",
        num_processes=2,
        kwargs={"scenarios": [r for r, _, _ in SCENARIOS]},
        timeout_s=120,
    )
    assert [r["process_index"] for r in res] == [0, 1]
    for k, (requests, after, why) in enumerate(SCENARIOS):
        runs = [r["runs"][k] for r in res]
        assert [r["stopped_after"] for r in runs] == [after, after], (requests, runs)
        if why is not None:
            assert [r["why"] for r in runs] == why, (requests, runs)
        else:
            reasons = {r["why"] for r in runs}
            assert reasons in ({"SIGTERM", "SIGTERM to process 1"}, {"SIGTERM", "SIGTERM to process 0"}), runs
