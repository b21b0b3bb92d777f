"""``python -m experiments.train_gpt``: the old name of the trainer CLI, :mod:`experiments.gpt.train`."""

from experiments.gpt.train import cli

if __name__ == "__main__":
    raise SystemExit(cli())
