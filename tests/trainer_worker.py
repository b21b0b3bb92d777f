"""Worker for tests/test_trainer_cluster.py, run in each process by experiments.shelf.multiproc:
trainer CLI runs, one after the other; returns this process's view of each."""

import jax

from experiments.gpt import train as tg
from experiments.gpt.args import parse_args


def train(argvs: list[list[str]]) -> dict:
    runs = []
    for argv in argvs:
        result = tg.run_cli(parse_args(argv), print_summary=False)
        runs.append(
            {"losses": [h.loss for h in result.history], "val_loss": result.val_loss, "n_devices": result.n_devices}
        )
    return {"process_index": jax.process_index(), "process_count": jax.process_count(), "runs": runs}


def stop_resume_overwrite(argv: list[str], straight: str, out: str, stop_at: dict[str, int]) -> dict:
    """In every process: a straight run (``--out straight``); then a run with checkpoints in
    ``out`` stopped by SIGTERM to this process's group after step ``stop_at[process]`` (the
    processes stop and save after one agreed step); then ``--resume``; then a fresh
    ``--overwrite`` run over the same checkpoint directory. The losses of each (the resumed
    run's history includes the rows before the stop)."""
    import os
    import signal

    from experiments.gpt import trainer as tr
    from experiments.gpt.run_files import Stopped

    def losses(args):
        return [h.loss for h in tg.run_cli(parse_args(args), print_summary=False).history]

    ckpt = [*argv, "--out", out, "--checkpoint-every", "2"]
    result = {"straight": losses([*argv, "--out", straight])}
    real = tr.Trainer.steps

    def steps(self):
        for log in real(self):
            if log.step == stop_at[str(jax.process_index())]:
                os.killpg(os.getpgid(0), signal.SIGTERM)  # the real signal and handler, as a scheduler sends it
            yield log

    tr.Trainer.steps = steps
    try:
        losses(ckpt)
        result["stopped"] = None
    except Stopped as e:
        result["stopped"] = str(e)
    finally:
        tr.Trainer.steps = real
    result["resumed"] = losses([*ckpt, "--resume"])
    result["overwritten"] = losses([*ckpt, "--overwrite"])
    result["process_index"] = jax.process_index()
    return result
