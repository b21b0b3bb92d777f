"""Processes of a multi-process run that agree on their settings, or stop together.

Every process of a ``jax.distributed`` run must run the same program with the same settings;
a process started with another learning rate or seed trains on without an error, and one with
another model or step count blocks in a collective until a timeout that names nothing. So,
right after ``jax.distributed`` starts::

    from qsdp_jax import distributed
    distributed.initialize()
    distributed.check_agreement({"lr": lr, "seed": seed, "steps": steps, "config": cfg_dict})

Every process sends its settings to process 0 through ``jax.distributed``'s key-value store
(no device, no collective); process 0 compares them with its own and sends back one verdict,
so every process raises the same :class:`SettingsMismatch` naming the settings that differ,
the process and both values, within seconds. A process that does not reach the check within
``timeout_s`` is named too (:class:`AgreementTimeout`). With one process both functions return
at once. :func:`agree_on_error` makes a check that only some processes can do (process 0's
output directory, say) fail on all of them.

Calls are matched by order: every process must make the same calls in the same order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from jax._src import distributed as jax_distributed  # its key-value store client

__all__ = ["AgreementTimeout", "SettingsMismatch", "agree_on_error", "check_agreement", "from_process_0"]

_PREFIX = "qsdp_jax/agreement"
_SHOWN = 5  # differences named in the message
_CALLS: dict[str, int] = {}


class SettingsMismatch(ValueError):
    """The processes' settings differ; ``differences`` holds ``(key, process, value, value of
    process 0)`` tuples."""

    def __init__(self, message: str, differences=()):
        super().__init__(message)
        self.differences = list(differences)


class AgreementTimeout(TimeoutError):
    """A process did not reach the agreement check in time."""


def client_and_ids():
    """``(client, process_id, num_processes)`` of the running ``jax.distributed``, or None when
    there is only one process (nothing started)."""
    state = jax_distributed.global_state
    if state.client is None or not state.num_processes or state.num_processes <= 1:
        return None
    return state.client, int(state.process_id), int(state.num_processes)


def flatten(settings: Mapping, prefix: str = "") -> dict[str, object]:
    """``{"qsdp": {"bits": 8}}`` -> ``{"qsdp.bits": 8}``, values as JSON would carry them
    (tuples as lists, paths and other objects as their ``str``, non-finite floats by name)."""
    out: dict[str, object] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.loads(json.dumps(_plain(value), default=str))
    return out


def _plain(value):
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _exchange(what: str, payload: str, decide, timeout_s: float) -> Any:
    """Every process sends ``payload`` to process 0; process 0 calls ``decide({process: payload})``
    (or writes a timeout verdict) and every process gets its answer back (what ``decide``
    returned, through JSON)."""
    client, me, n = client_and_ids()
    call = _CALLS.get(what, 0)
    _CALLS[what] = call + 1
    key = f"{_PREFIX}/{what}/{call}"
    client.key_value_set(f"{key}/in/{me}", payload)
    if me == 0:
        import time

        deadline = time.monotonic() + timeout_s
        got = {0: payload}
        verdict = None
        for j in range(1, n):
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                got[j] = client.blocking_key_value_get(f"{key}/in/{j}", left_ms)
            except Exception as e:  # noqa: BLE001 - a deadline (or a gone peer) is the answer
                verdict = json.dumps(
                    {
                        "timeout": (
                            f"process {j} of {n} did not reach the {what} check within {timeout_s:g} s "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); every process must "
                            "run the same program"
                        )
                    }
                )
                break
        if verdict is None:
            verdict = json.dumps({"answer": decide(got)})
        client.key_value_set(f"{key}/out", verdict)
    else:
        try:
            verdict = client.blocking_key_value_get(f"{key}/out", int((timeout_s + 10) * 1000))
        except Exception as e:  # noqa: BLE001
            raise AgreementTimeout(
                f"process {me} of {n}: no verdict from process 0 on the {what} check within "
                f"{timeout_s + 10:g} s ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            ) from None
    verdict = json.loads(verdict)
    if "timeout" in verdict:
        raise AgreementTimeout(verdict["timeout"])
    return verdict["answer"]


def _compare(views: dict[int, str]) -> dict:
    base = json.loads(views[0])
    differences = []
    for j in sorted(views)[1:]:
        mine = json.loads(views[j])
        for k in sorted(set(base) | set(mine)):
            if mine.get(k, "<not set>") != base.get(k, "<not set>"):
                differences.append((k, j, mine.get(k, "<not set>"), base.get(k, "<not set>")))
    return {"differences": differences}


def check_agreement(settings: Mapping, *, what: str = "settings", timeout_s: float = 60.0) -> None:
    """Raise :class:`SettingsMismatch` on every process unless every process passed the same
    ``settings`` as process 0 (a no-op with one process).

    Args:
      settings: this process's settings, a (nested) mapping of JSON-like values; leave out what
        may differ between processes (process id, local devices, log paths).
      what: a name for the check, in messages and in the key-value store's keys.
      timeout_s: how long process 0 waits for the others to reach the check.

    Raises:
      SettingsMismatch: on every process, naming each differing setting (up to 5), the process
        and both values.
      AgreementTimeout: a process did not reach the check within ``timeout_s``.
    """
    if client_and_ids() is None:
        return
    answer = _exchange(what, json.dumps(flatten(settings), sort_keys=True), _compare, timeout_s)
    differences = [tuple(d) for d in answer["differences"]]
    if not differences:
        return
    shown = "; ".join(
        f"process {j} has {k}={_short(v)}, process 0 has {k}={_short(v0)}" for k, j, v, v0 in differences[:_SHOWN]
    )
    more = len(differences) - _SHOWN
    keys = sorted({d[0] for d in differences})
    raise SettingsMismatch(
        f"the processes of this run were started with different {what}: {shown}"
        + (f" (and {more} more)" if more > 0 else "")
        + f". Start every process with the same {', '.join(keys)}.",
        differences,
    )


def agree_on_error(error: str | None, *, what: str = "setup", timeout_s: float = 60.0) -> str | None:
    """Every process passes its own error message (None if it has none); every process gets
    the first one, ``"process i: message"``, or None when no process has one. Use it to make a
    check that fails on some processes only stop all of them (a no-op with one process)."""
    if client_and_ids() is None:
        return None if error is None else error

    def first(views: dict[int, str]):
        for j in sorted(views):
            e = json.loads(views[j])
            if e is not None:
                return f"process {j}: {e}"
        return None

    return _exchange(what, json.dumps(error), first, timeout_s)


def from_process_0(value, *, what: str = "value", timeout_s: float = 60.0):
    """Process 0's ``value`` (JSON-like) on every process, e.g. a default output path with a
    timestamp in it; ``value`` itself with one process."""
    if client_and_ids() is None:
        return value
    return json.loads(_exchange(what, json.dumps(value), lambda views: views[0], timeout_s))


def _short(value, limit: int = 120) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
