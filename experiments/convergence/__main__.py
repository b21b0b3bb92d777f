"""``python -m experiments.convergence``: the study's command (:mod:`experiments.convergence.run`)."""

from experiments.convergence.run import main

if __name__ == "__main__":
    raise SystemExit(main())
