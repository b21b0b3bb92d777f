"""The command-line flags of a GPT small enough for a test, shared by the tests that start the trainer."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "testdata" / "shakespeare_small.txt"


def trainer_flags(*, d_model: int = 16, n_layers: int = 1, seq_len: int = 16, batch: int = 4, **flags) -> list[str]:
    """Model and data flags of a tiny GPT on the test corpus, then ``flags`` in the order given.

    A keyword becomes its flag (``min_shard_size=256`` -> ``--min-shard-size 256``); ``True`` gives
    the bare flag (``quiet=True`` -> ``--quiet``); ``None`` or ``False`` leaves it out.
    """
    every = dict(
        d_model=d_model,
        n_heads=2,
        n_layers=n_layers,
        seq_len=seq_len,
        batch=batch,
        bucket_size=64,
        eval_batches=1,
        data=DATA,
        **flags,
    )
    argv: list[str] = []
    for name, value in every.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv
