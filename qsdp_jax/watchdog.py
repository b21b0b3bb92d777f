"""Bounded failure: a process whose train steps stop finishing exits with a clear message.

In a multi-process run every step is a collective over all processes: when one process dies or
freezes, the others block inside the next collective. JAX's coordination service notices a dead
peer only after its heartbeat timeout (100 s by default) and then aborts the process from C++
with no Python exception; a frozen peer that still sends heartbeats is never noticed. So::

    dog = StepWatchdog(timeout_s=60, on_timeout=try_save)   # armed by the first beat()
    for ...:
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        dog.beat(int(state.step))
    dog.stop()

A collective may also raise (gloo: "Connection reset by peer"): pass the error to
:meth:`StepWatchdog.fail`, which does the same at once (a normal exit would wait in JAX's
shutdown barrier for the dead peer until the heartbeat timeout, then abort).

When no ``beat()`` comes for ``timeout_s`` seconds, the watchdog calls ``on_timeout`` (e.g. a
checkpoint save) in a helper thread for at most ``save_timeout_s`` seconds, prints what happened
on stderr, and ends the process with ``exit_code`` (``os._exit``: the main thread is stuck in a
collective and cannot unwind). Give ``jax.distributed.initialize`` a ``heartbeat_timeout_seconds``
larger than ``timeout_s + save_timeout_s`` so that the message comes before JAX's abort.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Callable

EXIT_CODE = 75  # EX_TEMPFAIL: try again (restart and resume)


def _default_exit(code: int) -> None:
    os._exit(code)  # the main thread is stuck in a collective: no unwinding


def save_or_explain(save: Callable[[], bool], state, latest_step: Callable[[], int | None]) -> str:
    """For ``on_timeout``: run ``save()`` unless ``state``'s buffers were donated to the step
    that is now stuck; a sentence saying what happened and which checkpoint a restart uses."""
    import jax

    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(state)):
        return (
            f"Not saved: the last state was donated to the step that cannot finish; the "
            f"last complete checkpoint is step {latest_step()}"
        )
    save()
    return f"Saved step {int(jax.device_get(state.step))}"


def _where(error: BaseException) -> str:
    """`` (at file.py:123)``: where ``error`` was raised, so that a bug in ``on_timeout`` (a
    NameError, say) reads as one and not as a failed save."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


class StepWatchdog:
    """Ends the process when train steps stop finishing (see the module docstring).

    The watching thread starts at construction; the first :meth:`beat` arms it. Also a context
    manager (``with StepWatchdog(...) as dog:``; leaving it calls :meth:`stop`).

    Args:
      timeout_s: the bound: seconds without a finished step (> 0, default 60).
      on_timeout: called once before exiting (e.g. try to save); returns a short description
        of what it did; it runs in its own thread and is abandoned after ``save_timeout_s``.
        An exception it raises is reported in the message. None (the default): no save.
      save_timeout_s: how long ``on_timeout`` may take (>= 0, default 10).
      exit_code: the process's exit status (default 75, ``EX_TEMPFAIL``: restart and resume).
      what: a name for the message (e.g. ``"process 1 of 2"``; default ``"this process"``).

    Raises:
      ValueError: ``timeout_s`` is not > 0, or ``save_timeout_s`` not >= 0.
    """

    def __init__(
        self,
        timeout_s: float = 60.0,
        *,
        on_timeout: Callable[[], str] | None = None,
        save_timeout_s: float = 10.0,
        exit_code: int = EXIT_CODE,
        what: str = "this process",
        _exit: Callable[[int], None] | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: must be > 0")
        if not save_timeout_s >= 0:
            raise ValueError(f"save_timeout_s={save_timeout_s!r} is invalid: must be >= 0")
        self.timeout_s = float(timeout_s)
        self.save_timeout_s = float(save_timeout_s)
        self.on_timeout = on_timeout
        self.exit_code = exit_code
        self.what = what
        self._exit = _exit
        self._last: tuple[float, int] | None = None  # (monotonic time, step) of the last beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="qsdp-step-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        """A step finished (arms the watchdog on the first call).

        Args:
          step: the step that finished, named in the message if the watchdog fires later.
        """
        self._last = (time.monotonic(), int(step))

    def fail(self, error: BaseException) -> None:
        """A collective raised (e.g. gloo's "Connection reset by peer" when a peer died): the
        same message, save attempt and exit as a timeout, now. Never returns (unless a test's
        ``_exit`` does).

        Args:
          error: the exception the collective raised (its type and first line go into the
            message).
        """
        self._stop.set()
        last = self._last[1] if self._last is not None else 0
        self._fire(last, f"a collective failed ({type(error).__name__}: {str(error).splitlines()[0][:300]})")

    def stop(self) -> None:
        """Stop watching (e.g. after the last step) and wait for the watching thread to end."""
        self._stop.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            last = self._last
            if last is not None and time.monotonic() - last[0] > self.timeout_s:
                self._fire(last[1], f"finished no train step for {self.timeout_s:g} s")
                return

    def _fire(self, step: int, happened: str) -> None:
        saved = "No save attempted"
        on_timeout = self.on_timeout
        if on_timeout is not None:
            result: list[str] = []

            def attempt():
                try:
                    result.append(on_timeout())
                except BaseException as e:  # noqa: BLE001 - reported below
                    result.append(f"The save failed: {type(e).__name__}: {str(e).rstrip('.')}{_where(e)}")

            t = threading.Thread(target=attempt, name="qsdp-watchdog-save", daemon=True)
            t.start()
            t.join(self.save_timeout_s)
            saved = (
                result[0]
                if result
                else (
                    f"The save did not finish within {self.save_timeout_s:g} s (the state is sharded "
                    "over the processes: with one gone it cannot be gathered)"
                )
            )
        sys.stderr.write(
            f"\nqsdp_jax watchdog: {self.what} {happened} after step {step}: another process of "
            f"the run most likely died or froze, and the collectives need it. {saved}. Exiting "
            f"with status {self.exit_code}; restart the run to resume from its last complete "
            "checkpoint.\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        (self._exit or _default_exit)(self.exit_code)
