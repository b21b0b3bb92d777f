"""Bounded start and bounded failure of a multi-process run, with a message that says why.

JAX's coordination service ends a process from C++ when something goes wrong between the
processes: a stack trace and status 134 that name no process. When the processes never all
connect (one not started, a wrong port, two with the same ``--process-id``) that happens only
after ``initialization_timeout`` (300 s by default); when a process dies, the others are aborted
at once (the coordinator died) or after the heartbeat timeout, and a frozen one is noticed only
then. jax 0.10 cannot call Python instead: its ``missed_heartbeat_callback`` cannot pass the
error to Python (nanobind ``std::bad_cast``, then ``std::terminate``). This module comes first:

* :func:`connect_guard` (in :mod:`qsdp_jax._src.distributed.connect_guard`, re-exported here; used by
  :func:`qsdp_jax.distributed.initialize`): if ``jax.distributed.initialize`` has not returned
  within the bound, print what is wrong (nothing listens at the coordinator's address, or it
  does but not every process joined) and exit with :data:`EXIT_NOT_CONNECTED`, before JAX's own
  ``initialization_timeout``.
* :class:`PeerMonitor` (:func:`qsdp_jax.distributed.watch_peers`): process 0 and every other
  process keep a plain TCP connection (process 0 listens on a free port it publishes through
  JAX's key-value store) and send a heartbeat byte every ``timeout_s / 5``. A connection that
  closes (the process died, was killed or exited before the run finished) is seen at once, a
  silence of ``timeout_s`` means a frozen process or a lost network; process 0 tells the others,
  and every process prints which process is gone and exits with :data:`EXIT_PEER_LOST` (75:
  restart and resume). Set JAX's heartbeat timeout above ``timeout_s`` so this comes first.
  When process 0 dies, its coordination service lives on in its helper process
  (:mod:`qsdp_jax._src.distributed.service_host`), so JAX sees the death only after its heartbeat timeout
  too, and the monitor comes first by construction. With the service inside process 0
  (``DistributedSettings(service_helper=False)``, or a cluster JAX detects by itself), JAX
  aborts the others at the moment process 0 dies, and the monitor's message comes first only
  in practice.

A process that finishes calls :meth:`PeerMonitor.finish` (or leaves the ``with`` block) so that
its exit is not taken for a death. One that fails calls :meth:`PeerMonitor.fail`, which first
waits up to ``_FAIL_WAIT_S`` for a peer's connection to close: a peer's death is what makes a
collective fail, and its connection may close a moment after the error reaches this process.
"""

from __future__ import annotations

import atexit
import logging
import select
import selectors
import socket
import threading
import time
from typing import Callable, cast

from jax._src import distributed as jax_distributed

from qsdp_jax._src.distributed import agreement
from qsdp_jax._src.distributed.connect_guard import (  # noqa: F401  (connect_guard, check_port_free: part of this module's API)
    EXIT_NOT_CONNECTED,
    check_port_free,
    connect_guard,
    exit_now,
    host_port,
    say,
)

__all__ = ["EXIT_NOT_CONNECTED", "EXIT_PEER_LOST", "PeerMonitor", "check_port_free", "connect_guard"]

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: as qsdp_jax.watchdog: restart the run and resume
_KEY = "qsdp_jax/peers"
_SESSIONS = {"n": 0}
_GRACE_S = 2.0
_FAIL_WAIT_S = 0.5  # how long a failing process waits for a peer's connection to close


class PeerMonitor:
    """Watches the other processes of a run; see the module docstring.

    Args:
      timeout_s: seconds of silence after which a process counts as frozen or unreachable
        (a process whose connection closes is seen at once).
      exit_code: this process's status when a peer is lost.
      connect_timeout_s: how long to wait for process 0's port (jax's key-value store) and
        the connection; without one, a warning, and no monitoring.
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        *,
        exit_code: int = EXIT_PEER_LOST,
        connect_timeout_s: float = 60.0,
        _exit: Callable[[int], None] | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: must be > 0")
        self.timeout_s = float(timeout_s)
        self.exit_code = exit_code
        self.connect_timeout_s = float(connect_timeout_s)
        self._exit = _exit or exit_now
        self._sel = selectors.DefaultSelector()
        self._conns: dict[socket.socket, dict] = {}  # socket -> {"id", "buf", "seen", "done"}
        self._stop = threading.Event()
        self._reported = threading.Lock()  # held by the one report of a lost peer
        self._wake: tuple[socket.socket, socket.socket] | None = None  # interrupts the thread's select
        self._thread: threading.Thread | None = None
        self._started = False
        self._server: socket.socket | None = None
        # (when, what, relay): a peer said it stops; lost unless we stop too
        self._pending: tuple[float, str, bool] | None = None
        self.me, self.n = 0, 1

    # -- starting ---------------------------------------------------------------------------

    def start(self) -> "PeerMonitor":
        """Connect to the other processes and start watching (a no-op with one process)."""
        ids = agreement.client_and_ids()
        if ids is None or self._started:
            return self
        self._started = True
        client, self.me, self.n = ids
        self._wake = socket.socketpair()
        self._sel.register(self._wake[0], selectors.EVENT_READ, "wake")
        key = f"{_KEY}/{_SESSIONS['n']}/port"
        _SESSIONS["n"] += 1
        try:
            if self.me == 0:
                self._listen(client, key)
            else:
                self._connect(client, key)
        except Exception as e:  # noqa: BLE001 - monitoring is best effort; say so
            say(
                f"process {self.me} of {self.n}: cannot watch the other processes "
                f"({type(e).__name__}: {e}); a lost process ends this one only through JAX's "
                "heartbeat timeout"
            )
            self._release()
            return self
        self._thread = threading.Thread(target=self._run, name="qsdp-peer-monitor", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)
        logging.getLogger("qsdp_jax").info(
            "peer monitor: process %d of %d watches the others (timeout %g s)", self.me, self.n, self.timeout_s
        )
        return self

    def _listen(self, client, key: str) -> None:
        if socket.has_dualstack_ipv6():
            server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            server = socket.create_server(("", 0))
        server.setblocking(False)
        self._sel.register(server, selectors.EVENT_READ, "listen")
        self._server = server
        client.key_value_set(key, str(server.getsockname()[1]))

    def _connect(self, client, key: str) -> None:
        port = int(client.blocking_key_value_get(key, int(self.connect_timeout_s * 1000)))
        address = jax_distributed.global_state.coordinator_address
        assert address is not None  # set by jax.distributed.initialize, before its client
        host = host_port(address)[0]
        sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        sock.sendall(f"HELLO {self.me}\n".encode())
        self._add(sock, 0)

    def _add(self, sock: socket.socket, peer: int | None) -> None:
        sock.setblocking(False)
        self._conns[sock] = {"id": peer, "buf": b"", "seen": time.monotonic(), "done": False}
        self._sel.register(sock, selectors.EVENT_READ, "conn")

    # -- the watching thread ----------------------------------------------------------------

    def _run(self) -> None:
        interval = min(1.0, self.timeout_s / 5)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._send_all(b"H\n")
                next_beat = now + interval
            for sel_key, _ in self._sel.select(timeout=max(0.0, next_beat - now)):
                if self._stop.is_set():
                    return
                if sel_key.data == "wake":
                    return
                sock = cast(socket.socket, sel_key.fileobj)  # only sockets are registered
                if sel_key.data == "listen":
                    try:
                        self._add(sock.accept()[0], None)
                    except OSError:  # the client went away before we accepted it
                        pass
                else:
                    self._read(sock)
            now = time.monotonic()
            if self._pending is not None and now >= self._pending[0]:
                self._lost(self._pending[1], relay=self._pending[2])
            for info in list(self._conns.values()):
                if info["id"] is not None and not info["done"] and now - info["seen"] > self.timeout_s:
                    self._lost(
                        f"{self._name(info['id'])} sent no heartbeat for {self.timeout_s:g} s: "
                        "it froze (stopped, or stuck holding the Python lock), or its host "
                        "or the network went down"
                    )

    def _read(self, sock: socket.socket) -> None:
        info = self._conns.get(sock)
        if info is None:
            return
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            if info["id"] is not None and not info["done"] and self._pending is None:
                self._lost(f"{self._name(info['id'])} died or was killed: its connection closed before it finished")
            return
        info["seen"] = time.monotonic()
        info["buf"] += data
        while b"\n" in info["buf"]:
            line, info["buf"] = info["buf"].split(b"\n", 1)
            self._message(info, line.decode(errors="replace"))

    def _message(self, info: dict, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "HELLO":
            info["id"] = int(rest)
        elif word == "BYE":
            info["done"] = True
        elif word in ("EXIT", "GONE"):
            # a process that stops with an error: lost, unless this one stops too within the
            # grace (the same error everywhere: each exits with its own status and message)
            what = rest if word == "GONE" else (f"{self._name(info['id'])} stopped before the run finished ({rest})")
            info["done"] = True
            if self._pending is None:
                self._pending = (time.monotonic() + _GRACE_S, what, word == "EXIT")

    def _name(self, peer: int) -> str:
        return f"process {peer} of {self.n}" + (" (the coordinator)" if peer == 0 else "")

    def _lost(self, what: str, relay: bool = True) -> None:
        if not self._reported.acquire(blocking=False):
            return  # reported already (by the other thread)
        self._stop.set()
        if self.me == 0 and relay:  # tell the others before going
            self._send_all(f"GONE {what}\n".encode(), blocking=True)
        say(
            f"process {self.me} of {self.n} stops: {what}. Exiting with status "
            f"{self.exit_code}; restart the run to resume from its last complete checkpoint."
        )
        self._exit(self.exit_code)

    def _send_all(self, data: bytes, blocking: bool = False) -> None:
        # to every connection, also one whose HELLO is still unread: it is a peer all the same
        for sock in list(self._conns):
            try:
                if blocking:
                    sock.settimeout(1.0)
                    sock.sendall(data)
                else:
                    sock.send(data)
            except OSError:
                pass  # a full buffer (a frozen peer) or a closed connection: seen elsewhere

    def _drain(self, wait_s: float = 0.0) -> None:
        """Read what has arrived (a closed connection included), and what arrives within
        ``wait_s``, unless a lost peer is reported first."""
        deadline = time.monotonic() + wait_s
        while True:
            socks = list(self._conns)
            for sock in socks:
                self._read(sock)
            left = deadline - time.monotonic()
            if left <= 0 or self._reported.locked() or not socks:
                return
            select.select([s for s in socks if s in self._conns], [], [], left)

    def _accept_waiting(self) -> None:
        """Process 0: accept the connections still in the listening socket's backlog (a peer
        connected, the watching thread had not got to it), so that the last message reaches
        them; closing the listening socket would reset them, a death to the peer."""
        while self._server is not None:
            try:
                sock = self._server.accept()[0]
            except OSError:  # BlockingIOError: none left
                return
            self._add(sock, None)

    def _drop(self, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    # -- ending -----------------------------------------------------------------------------

    def finish(self) -> None:
        """This process is done with the collectives: tell the others (so that its exit is not
        a death) and stop watching."""
        self._close(b"BYE\n")

    def fail(self, reason: str) -> None:
        """This process stops before the run finished (an error): the others stop at once,
        naming it. A peer whose connection closes within ``_FAIL_WAIT_S`` (0.5 s) is reported
        as lost instead (status 75). Returns (the caller goes on with its own error)."""
        self._close(f"EXIT {reason.splitlines()[0][:300] if reason else 'no reason given'}\n".encode())

    def _at_exit(self) -> None:
        self.fail("the process exited; its output says why")

    def _close(self, message: bytes) -> None:
        if self._thread is None or self._wake is None or self._stop.is_set():
            return  # (start() makes the socket pair before the thread)
        self._stop.set()
        self._wake[1].send(b"x")
        self._thread.join(timeout=5)
        self._accept_waiting()
        if message.startswith(b"EXIT"):
            # a peer lost at the moment this process fails is the news, and the peer's death
            # that made this process's collective fail may close its connection a moment later
            self._drain(wait_s=_FAIL_WAIT_S)
        if self.me == 0 and message.startswith(b"EXIT"):
            message = f"GONE {self._name(0)} stopped before the run finished ({message[5:-1].decode()})\n".encode()
        self._send_all(message, blocking=True)
        self._release()
        atexit.unregister(self._at_exit)

    def _release(self) -> None:
        for sock in [*self._conns, self._server, *(self._wake or ())]:
            if sock is not None:
                self._drop(sock)

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.fail(f"{exc_type.__name__}: {exc}")
