"""``python -m experiments.train_gpt``: the old name of the trainer CLI, :mod:`experiments.gpt.train`."""

from experiments.gpt.train import main

if __name__ == "__main__":
    raise SystemExit(main())
