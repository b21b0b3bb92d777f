"""Run files that survive being killed: resumable metrics, stop signals, and the trainer's
checkpoints (qsdp_jax.Checkpointer).

* :class:`MetricsLog`: ``metrics.jsonl`` streamed one line per step; a resumed run cuts the rows
  after its checkpoint (they will be redone) and a torn last line, then appends, so the file
  holds every step once, in order. Every line is strict JSON: a NaN or infinite number (a
  diverged loss) is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``
  (``files.dumps_strict``) and read back as the float.
* :class:`StopSignals`: SIGTERM / SIGINT set a flag; the training loop
  (``experiments.gpt.train.train_loop``) stops after the current step and saves.
* :class:`RunCheckpoints`: saves every N steps (asynchronously), keeps the last K, restores the
  latest complete one.

Imports no jax at the top: the trainer CLI imports this module before it sets the device flags.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import TextIO

from experiments.gpt.args import CLIError
from experiments.gpt.files import NONFINITE, dumps_strict, write_atomic


def _read_row(row: dict) -> dict:
    """A row as :func:`dumps_strict` wrote it, with ``"NaN"``/``"Infinity"``/``"-Infinity"``
    back as floats."""
    return {k: NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


def is_process_0() -> bool:
    """True in the process that renames and deletes shared files (the only one, or process 0)."""
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process of a multi-process run gets here (a no-op with one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class MetricsLog:
    """``metrics.jsonl``, one JSON row per step, written as training goes.

    ``start_step``: the step training resumes from (0 for a fresh run). Rows with a larger step
    (done after the checkpoint, redone now) and an unparsable last line (torn by a kill) are
    dropped; a gap (a row missing before ``start_step``) is an error. ``rows`` holds the kept
    rows.
    """

    def __init__(self, path, start_step: int = 0, write: bool = True):
        self.path = Path(path)
        self.write = write  # False: keep the rows in memory only (processes other than 0)
        self.rows: list[dict] = []
        if start_step > 0 and self.path.exists():
            lines = self.path.read_text().splitlines()
            for i, line in enumerate(lines):
                try:
                    row = _read_row(json.loads(line))
                except json.JSONDecodeError:
                    if i == len(lines) - 1:  # torn last line
                        break
                    raise ValueError(f"{self.path}: line {i + 1} is not JSON") from None
                if row["step"] <= start_step:
                    self.rows.append(row)
        steps = [r["step"] for r in self.rows]
        if write and steps != list(range(1, start_step + 1)):
            raise ValueError(
                f"{self.path} does not hold the rows of steps 1..{start_step} the checkpoint "
                f"continues from (has {len(steps)} rows, up to {max(steps, default=0)})"
            )
        self._f: TextIO | None = None  # the old file is replaced only once there is a row to replace it with

    def append(self, row: dict) -> None:
        if not self.write:
            self.rows.append(row)
            return
        if self._f is None:
            write_atomic(self.path, "".join(dumps_strict(r) + "\n" for r in [*self.rows, row]))
            self._f = open(self.path, "a")
        else:
            self._f.write(dumps_strict(row) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class StopSignals:
    """While active, SIGTERM and SIGINT set :attr:`received` (the signal's name) instead of
    killing the process; a second SIGINT raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.received: str | None = None
        self._old = {}

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


@dataclasses.dataclass
class RunCheckpoints:
    """The trainer's checkpoints: ``every`` steps (and on stop), the last ``keep`` kept."""

    directory: Path
    every: int | None
    keep: int = 3

    def __post_init__(self):
        import qsdp_jax as q

        self.replaced: Path | None = None  # an earlier run's checkpoints moved aside (--overwrite)
        self.ckpt = q.Checkpointer(self.directory, keep=self.keep)

    @staticmethod
    def identity(trainer) -> dict:
        """What a resumed run must share with the checkpoint (settings that change training)."""
        d = trainer.run.as_dict()
        for k in ("qsdp", "qsdp_name", "eval_every", "eval_batches"):
            d.pop(k, None)  # the QSDPConfig is checked field by field on its own
        d.pop("mesh", None)  # a checkpoint restores onto any mesh shape (qsdp_jax.checkpoint)
        for k in ("mu_dtype", "moments_dtype"):  # the defaults: absent, as in checkpoints made before them
            if d.get(k) == "float32":
                d.pop(k)
        return d

    def latest_step(self) -> int | None:
        return self.ckpt.latest_step()

    def restore(self, trainer) -> int:
        """Load the latest complete checkpoint into ``trainer.state``; returns its step."""
        state, extra = self.ckpt.restore(trainer.state, trainer.run.qsdp, trainer.mesh, identity=self.identity(trainer))
        trainer.state = state
        step = int(state.step)
        if extra.get("data_position", step) != step:
            raise ValueError(f"checkpoint data position {extra['data_position']} != its step {step}")
        return step

    def save(self, trainer, *, force: bool = False) -> bool:
        """Save at the state's step if it is a multiple of ``every`` (or ``force``)."""
        step = int(trainer.state.step)
        if not force and (not self.every or step % self.every):
            return False
        return self.ckpt.save(
            trainer.state,
            trainer.run.qsdp,
            trainer.mesh,
            identity=self.identity(trainer),
            extra={"data_position": step, "seed": trainer.run.seed},
        )

    def close(self) -> None:
        self.ckpt.close()

    def finish(self, trainer) -> None:
        """At the end of training: save the last step, wait for every pending save, delete the
        checkpoints a fresh ``--overwrite`` run moved aside (process 0, once the final save is
        complete on every process), close."""
        self.save(trainer, force=True)
        self.ckpt.wait()
        if self.replaced is not None:
            if is_process_0():
                shutil.rmtree(self.replaced, ignore_errors=True)
            self.replaced = None
        self.close()


class Stopped(Exception):
    """Training stopped on a signal (after saving, when checkpoints are on); ``code`` is the exit
    status (128 + signal number)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def open_checkpoints(args, out: Path):
    """The run's :class:`RunCheckpoints` per the flags, or None when checkpoints are off.

    A fresh run (no ``--resume``) refuses a directory holding checkpoints unless ``--overwrite``;
    then the old checkpoints are moved aside and deleted only when the new run has saved its own.
    Every process of a multi-process run calls this (orbax's save and restore need them all);
    only process 0 renames or deletes, between barriers.
    """
    if args.checkpoint_dir is None and args.checkpoint_every is None and not args.resume:
        return None
    directory = Path(args.checkpoint_dir) if args.checkpoint_dir is not None else out / "checkpoints"
    if directory.exists() and not directory.is_dir():
        raise CLIError(f"--checkpoint-dir {directory} exists and is not a directory")
    has = directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())
    from qsdp_jax import distributed  # imports jax: prepare_run has set the device flags

    error = distributed.agree_on_error(unwritable(directory), what="checkpoint directory check")
    if error is not None:  # now, not at the first save after hours of training
        raise CLIError(error)
    aside = None
    if has and not args.resume:
        if not args.overwrite:
            raise CLIError(
                f"{directory} holds checkpoints of an earlier run: pass --resume to continue it, or "
                "--overwrite to start over (they are deleted once the new run has saved)"
            )
        aside = directory.with_name(directory.name + ".replaced")
    # Several processes on a shared filesystem: every process has looked at the directory before
    # process 0 alone moves it aside; none opens the new one (orbax creates it) before that.
    barrier("qsdp_jax: checkpoint directory checked")
    if aside is not None and is_process_0():
        if aside.exists():
            shutil.rmtree(aside)
        directory.rename(aside)
    barrier("qsdp_jax: old checkpoints moved aside")
    ckpts = RunCheckpoints(directory, args.checkpoint_every, args.keep)
    ckpts.replaced = aside
    return ckpts


def unwritable(directory: Path) -> str | None:
    """Why this process cannot save checkpoints in ``directory`` (created if missing), or None:
    a file is created in it and removed, as a save will."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".qsdp-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return (
            f"the checkpoint directory {directory} is not writable ({e.strerror or e}): no checkpoint "
            "could be saved; choose another with --checkpoint-dir"
        )
    return None


def resume_step(ckpts: RunCheckpoints, trainer, args) -> int:
    """With ``--resume``: the step restored from the latest complete checkpoint (0 when none)."""
    if not args.resume or ckpts.latest_step() is None:
        return 0
    try:
        return ckpts.restore(trainer)
    except ValueError as e:
        raise CLIError(f"cannot resume from {ckpts.directory}: {e}") from None
