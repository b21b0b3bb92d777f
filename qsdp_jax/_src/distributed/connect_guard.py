"""Bounded start of a multi-process run: :func:`connect_guard` and :func:`check_port_free`.

If ``jax.distributed.initialize`` has not returned within the bound, :func:`connect_guard` prints
what is wrong (nothing listens at the coordinator's address, or it does but not every process
joined) and exits with :data:`EXIT_NOT_CONNECTED`, before JAX's own ``initialization_timeout``
ends the process from C++ naming nothing (see :mod:`qsdp_jax._src.distributed.peers`, which re-exports both
and shares :func:`say`, :func:`exit_now` and :func:`host_port`). Used by
:func:`qsdp_jax.distributed.initialize`.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from typing import Callable

EXIT_NOT_CONNECTED = 69  # EX_UNAVAILABLE: the processes never all met


def exit_now(code: int) -> None:
    """End the process at once with ``code``."""
    os._exit(code)  # the main thread may be blocked in a collective: no unwinding


def say(text: str) -> None:
    """Print ``qsdp_jax: text`` to stderr, flushing stderr and stdout."""
    sys.stderr.write(f"\nqsdp_jax: {text}\n")
    sys.stderr.flush()
    sys.stdout.flush()


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` address (an IPv6 host without its brackets)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _accepts(address: str) -> bool:
    try:
        with socket.create_connection(host_port(address), timeout=2):
            return True
    except OSError:
        return False


def check_port_free(address: str) -> None:
    """ValueError if something listens on this host at ``address``'s port already (for process
    0, before it starts the coordinator there: another process 0, or another program)."""
    port = host_port(address)[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not ours to judge (permissions...): jax will say
            raise ValueError(
                f"the coordinator's port {port} ({address}) is already in use on this host: "
                "another process was started with process id 0 (do two processes share an "
                "id?), or another program listens there; choose another port"
            ) from None


def _not_connected(address: str, process_id: int, n: int, timeout_s: float) -> str:
    others = "process 1" if n == 2 else f"processes 1..{n - 1}"
    if process_id == 0:
        return (
            f"process 0 of {n} (the coordinator, at {address}) waited {timeout_s:g} s but not "
            f"all {n} processes connected to it: check that {others} started, with this "
            f"coordinator address and port and {n} processes, and that no two share a "
            "process id."
        )
    if not _accepts(address):
        return (
            f"process {process_id} of {n} did not connect to the coordinator {address} within "
            f"{timeout_s:g} s: nothing accepts connections there. Check that process 0 runs "
            "(it may have stopped with an error) and that this is the host and port it uses."
        )
    return (
        f"process {process_id} of {n} did not connect to the coordinator {address} within "
        f"{timeout_s:g} s: the coordinator runs there but not all {n} processes joined it. "
        f"Check that every process 0..{n - 1} started with {n} processes, and that no two "
        "share a process id."
    )


class connect_guard:  # noqa: N801 - used as a function: ``with connect_guard(...):``
    """While the ``with`` block runs (``jax.distributed.initialize``): if it has not finished
    after ``timeout_s``, print why and exit with ``exit_code``."""

    def __init__(
        self,
        address: str,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        *,
        exit_code: int = EXIT_NOT_CONNECTED,
        _exit: Callable[[int], None] | None = None,
    ):
        self.args = (address, process_id, num_processes, timeout_s)
        self.exit_code = exit_code
        self._exit = _exit or exit_now
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="qsdp-connect-guard", daemon=True)

    def _watch(self) -> None:
        if self._done.wait(self.args[3]):
            return
        say(_not_connected(*self.args) + f" Exiting with status {self.exit_code}.")
        self._exit(self.exit_code)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
