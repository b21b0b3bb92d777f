"""Worker for tests/test_trainer_cluster.py, run in each process by experiments.multiproc:
trainer CLI runs, one after the other; returns this process's view of each."""
import jax

from experiments import train_gpt as tg


def train(argvs: list[list[str]]) -> dict:
    runs = []
    for argv in argvs:
        result = tg.run_cli(tg.parse_args(argv), print_summary=False)
        runs.append({"losses": [h.loss for h in result.history], "val_loss": result.val_loss,
                     "n_devices": result.n_devices})
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "runs": runs}
