"""The processes of a multi-process run stop after the same step when any one of them is asked to.

A scheduler's SIGTERM reaches the processes of a job at slightly different moments: one may see
it after step 10, another after step 11. A process that stops on its own then saves while the
others wait in step 11's collectives (or save another step). :class:`StopVote` makes them agree
through ``jax.distributed``'s key-value store (no device, no collective): the first process that
is asked to stop writes "stop after step s + 1" under one key (written once: a second writer
reads the first's), and every process reads that key after each step and stops after step s + 1.

Why s + 1 is in time for everyone: a process checks after step t only once step t's results are
on its host, and step t's collectives need every process to have started step t. The writer
wrote before starting step s + 1, so every process that finishes step s + 1 finds the key by
then. Each check is one read of the store, about a millisecond on a cluster's network.

With one process there is nothing to agree: a request stops after the current step.
"""

from __future__ import annotations

import dataclasses
import json

from qsdp_jax._src.distributed import agreement

__all__ = ["StopVote"]

_PREFIX = "qsdp_jax/stop"
_VOTES = {"made": 0}  # votes made in this process: the n-th vote of every process shares a key


@dataclasses.dataclass(frozen=True)
class StopDecision:
    """Where a run stops: after ``step``, because ``process`` received ``reason``."""

    step: int
    reason: str
    process: int

    def describe(self, me: int) -> str:
        return self.reason if self.process == me else f"{self.reason} to process {self.process}"


class StopVote:
    """Ask every process of the run to stop after the same step (a loop's stop signal, say).

    Create one per training loop, in the same order on every process, and call :meth:`check`
    after every step once its results are on the host::

        vote = distributed.StopVote()
        for step in range(start, steps):
            metrics = jax.device_get(train_step(...))
            stop = vote.check(step + 1, "SIGTERM" if signals.received else None)
            if stop is not None:
                save(step + 1)
                break  # every process stops after the same step, saving the same checkpoint
    """

    def __init__(self):
        self._ids = agreement.client_and_ids()
        self._key = f"{_PREFIX}/{_VOTES['made']}"
        _VOTES["made"] += 1
        self.decision: StopDecision | None = None

    def check(self, step: int, request: str | None = None) -> str | None:
        """After step ``step`` has finished on this process: why the run stops now (``request``
        if it was this process's, else ``"<request> to process <i>"``), or None to go on.

        Args:
          step: the step just finished (its results fetched to the host).
          request: why this process wants to stop (e.g. ``"SIGTERM"``), or None.
        """
        if self._ids is None:
            if self.decision is None and request is not None:
                self.decision = StopDecision(step, request, 0)
        elif self.decision is None:
            self.decision = self._propose(step + 1, request) if request is not None else self._read()
        if self.decision is not None and step >= self.decision.step:
            return self.decision.describe(0 if self._ids is None else self._ids[1])
        return None

    def _propose(self, step: int, request: str) -> StopDecision:
        client, me, _ = self._ids
        try:
            client.key_value_set(self._key, json.dumps({"step": step, "reason": request, "process": me}))
        except Exception:  # noqa: BLE001 - written already (by another process first): theirs stands
            pass
        return self._read() or StopDecision(step, request, me)  # unreadable: the peer monitor will tell

    def _read(self) -> StopDecision | None:
        client = self._ids[0]
        try:
            value = client.key_value_try_get(self._key)
        except Exception:  # noqa: BLE001 - not written: no process asked to stop
            return None
        return StopDecision(**json.loads(value))
