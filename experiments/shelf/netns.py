"""Bandwidth-shaped network namespaces for single-machine communication experiments.

A fresh Linux network namespace has its own, private loopback device.  Processes
started inside it with ``ip netns exec <name> ...`` talk to each other over
``127.0.0.1`` of *that* loopback, and a ``tbf`` (token bucket filter) qdisc on
its egress turns it into a bandwidth-limited "network"::

    with shaped_namespace(rate_mbit=1000) as ns:
        subprocess.run(ns.wrap([sys.executable, "worker.py"]), check=True)

IMPORTANT - what the rate means: every packet of every process in the namespace,
in every direction, goes through the one egress queue of the one loopback
device.  The shaped rate is therefore the *total* (aggregate, bisection) rate of
the whole "cluster", not a per-link or per-direction rate: two processes that
exchange N bytes each way move 2N bytes through the single shaper.  An
all-gather of a global array of ``B`` bytes over ``P`` processes moves about
``(P - 1) * B`` bytes through it.

Requirements: root (CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2 (``ip``, ``tc``) and
a kernel/container that allows creating namespaces and the ``sch_tbf`` qdisc.
``check_netns_support()`` actually tries all of this and says why it fails.

Namespaces are always deleted on exit of ``shaped_namespace`` (normal exit,
exception, KeyboardInterrupt, and SIGTERM, which is turned into an exception
while the context is active).  Only SIGKILL can leave one behind; those are
named ``<prefix>-<pid>-<random>`` and ``cleanup_stale()`` removes the ones whose
creating process is gone (``python -m experiments.shelf.netns cleanup``).

No traffic ever leaves the namespace: it has no other interface than ``lo``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence

__all__ = [
    "NetnsError",
    "Terminated",
    "ShapedNamespace",
    "shaped_namespace",
    "check_netns_support",
    "list_namespaces",
    "cleanup_stale",
    "raise_on_sigterm",
]

DEFAULT_PREFIX = "qsdp"
MIN_BURST_KB = 256  # below this tbf stalls multi-MB transfers on a 9000-MTU loopback
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.]{0,23}$")  # no '-': it separates the pid
_CMD_TIMEOUT_S = 30.0


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed."""


class Terminated(SystemExit):
    """Raised (from a signal handler) when SIGTERM arrives inside a guarded block.

    A ``SystemExit`` subclass, so ``except Exception`` does not swallow it and an
    uncaught one exits the interpreter with status 143 (= 128 + SIGTERM), after
    ``finally`` blocks / context managers have cleaned up.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(128 + int(signum))
        self.signum = int(signum)


@contextlib.contextmanager
def raise_on_sigterm() -> Iterator[None]:
    """While active, SIGTERM raises ``Terminated`` in the main thread.

    The previous handler is restored on exit.  Outside the main thread (where
    signal handlers cannot be installed) this is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _handler(signum, frame):  # noqa: ARG001
        raise Terminated(signum)

    old = signal.signal(signal.SIGTERM, _handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except FileNotFoundError as e:
        raise NetnsError(f"{cmd[0]!r} not found: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"command timed out after {_CMD_TIMEOUT_S}s: {' '.join(cmd)}") from e
    if check and proc.returncode != 0:
        raise NetnsError(
            f"command failed (rc={proc.returncode}): {' '.join(cmd)}\n{(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def _validate(rate_mbit, mtu, burst_kb, latency_ms, name_prefix) -> None:
    if not isinstance(name_prefix, str) or not _PREFIX_RE.match(name_prefix):
        raise ValueError(f"name_prefix must match {_PREFIX_RE.pattern} (no '-', <= 24 chars), got {name_prefix!r}")
    if rate_mbit is not None:
        if isinstance(rate_mbit, bool) or not isinstance(rate_mbit, (int, float)):
            raise TypeError(f"rate_mbit must be a number or None, got {rate_mbit!r}")
        if not math.isfinite(rate_mbit) or rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be a finite number > 0, got {rate_mbit!r}")
        if rate_mbit * 1000 < 1:
            raise ValueError(f"rate_mbit must be >= 0.001 (1 kbit/s), got {rate_mbit!r}")
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 68 <= mtu <= 65536:
        raise ValueError(f"mtu must be an int in [68, 65536], got {mtu!r}")
    if isinstance(burst_kb, bool) or not isinstance(burst_kb, (int, float)) or not math.isfinite(burst_kb):
        raise TypeError(f"burst_kb must be a number, got {burst_kb!r}")
    if burst_kb < MIN_BURST_KB:
        raise ValueError(f"burst_kb must be >= {MIN_BURST_KB} (smaller bursts stall bulk transfers), got {burst_kb!r}")
    if burst_kb * 1024 < mtu:
        raise ValueError(f"burst ({burst_kb} kb) must be at least one MTU ({mtu} bytes)")
    if (
        isinstance(latency_ms, bool)
        or not isinstance(latency_ms, (int, float))
        or not math.isfinite(latency_ms)
        or latency_ms <= 0
    ):
        raise ValueError(f"latency_ms must be a finite number > 0, got {latency_ms!r}")


@dataclasses.dataclass(frozen=True)
class ShapedNamespace:
    """A live namespace created by ``shaped_namespace``.

    ``rate_mbit is None`` means unshaped (loopback at full speed, still MTU-limited).
    """

    name: str
    rate_mbit: float | None
    mtu: int
    burst_kb: float
    latency_ms: float

    def prefix(self) -> list[str]:
        """Command prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    # alias, reads better at call sites: subprocess.run(ns.command_prefix() + cmd)
    command_prefix = prefix

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``prefix() + cmd``."""
        return self.prefix() + [str(c) for c in cmd]

    def run(self, cmd: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``cmd`` inside the namespace (kwargs passed through)."""
        return subprocess.run(self.wrap(cmd), **kwargs)

    def qdisc_show(self) -> str:
        """Output of ``tc qdisc show dev lo`` inside the namespace."""
        return _run(self.wrap(["tc", "qdisc", "show", "dev", "lo"])).stdout

    def exists(self) -> bool:
        return self.name in list_namespaces(prefix=None)


def _tc_rate(rate_mbit: float) -> str:
    # integer kbit avoids any locale/float parsing quirk in tc; 1 mbit == 1000 kbit in tc
    return f"{max(1, int(round(rate_mbit * 1000)))}kbit"


def _tc_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3f}"


def _create(name: str, rate_mbit, mtu, burst_kb, latency_ms) -> None:
    _run(["ip", "netns", "add", name])
    try:
        exec_ = ["ip", "netns", "exec", name]
        _run(exec_ + ["ip", "link", "set", "dev", "lo", "mtu", str(mtu)])
        _run(exec_ + ["ip", "link", "set", "dev", "lo", "up"])
        if rate_mbit is not None:
            _run(
                exec_
                + [
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "lo",
                    "root",
                    "tbf",
                    "rate",
                    _tc_rate(rate_mbit),
                    "burst",
                    f"{_tc_num(burst_kb)}kb",
                    "latency",
                    f"{_tc_num(latency_ms)}ms",
                ]
            )
    except BaseException:
        _delete(name)
        raise


@contextlib.contextmanager
def _sigterm_blocked() -> Iterator[None]:
    """Defer SIGTERM (delivered on exit) so cleanup itself cannot be interrupted."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _delete(name: str) -> None:
    with _sigterm_blocked():
        _run(["ip", "netns", "delete", name], check=False)


@contextlib.contextmanager
def shaped_namespace(
    name_prefix: str = DEFAULT_PREFIX,
    rate_mbit: float | None = None,
    mtu: int = 9000,
    burst_kb: float = 512,
    latency_ms: float = 100.0,
) -> Iterator[ShapedNamespace]:
    """Create a uniquely named network namespace, optionally shape its loopback.

    Args:
      name_prefix: namespace name is ``f"{name_prefix}-{os.getpid()}-{random hex}"``.
      rate_mbit: egress rate of ``lo`` in Mbit/s (10^6 bit/s), or None for no
        shaping.  NOTE: all processes share the one loopback queue, so this is
        the *total* rate of all traffic in all directions inside the namespace.
      mtu: MTU of the namespace's ``lo`` (default 9000, like a jumbo-frame NIC;
        the kernel default of 65536 makes tbf very bursty).
      burst_kb: tbf bucket size in KiB (>= 256; smaller stalls bulk traffic).
      latency_ms: tbf ``latency`` = how long a packet may wait in the shaper's
        queue before being dropped (sizes the queue).  Generous by default so
        that TCP sees back-pressure instead of drops/retransmits.

    Yields a ``ShapedNamespace``.  The namespace is deleted on every exit path;
    SIGTERM raises ``Terminated`` inside the block (main thread only) and the
    previous SIGTERM handler is restored afterwards.  Processes still running
    inside a deleted namespace keep it alive (anonymously) until they exit, so
    stop them first.
    """
    _validate(rate_mbit, mtu, burst_kb, latency_ms, name_prefix)
    if rate_mbit is not None:
        rate_mbit = float(rate_mbit)
    name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(4)}"
    with raise_on_sigterm():
        created = False
        try:
            _create(name, rate_mbit, mtu, burst_kb, latency_ms)
            created = True
            yield ShapedNamespace(name=name, rate_mbit=rate_mbit, mtu=mtu, burst_kb=burst_kb, latency_ms=latency_ms)
        finally:
            if created:
                _delete(name)


def list_namespaces(prefix: str | None = DEFAULT_PREFIX) -> list[str]:
    """Names of existing network namespaces (those starting with ``prefix + '-'``).

    ``prefix=None`` lists all.
    """
    if shutil.which("ip") is None:
        return []
    proc = _run(["ip", "netns", "list"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        name = line.split()[0]  # "name (id: 3)"
        if prefix is None or name.startswith(prefix + "-"):
            names.append(name)
    return names


def _owner_pid(name: str, prefix: str) -> int | None:
    m = re.match(re.escape(prefix) + r"-(\d+)-[0-9a-f]+$", name)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = DEFAULT_PREFIX, only_dead_owners: bool = True) -> list[str]:
    """Delete leftover namespaces named ``<prefix>-...``; returns the deleted names.

    With ``only_dead_owners`` (default) a namespace is only removed when the pid
    encoded in its name no longer exists, so namespaces of experiments running
    concurrently (e.g. other pytest workers) are left alone.  Pass False to
    remove every namespace with the prefix.
    """
    removed = []
    for name in list_namespaces(prefix):
        pid = _owner_pid(name, prefix)
        if only_dead_owners and pid is not None and _pid_alive(pid):
            continue
        _delete(name)
        removed.append(name)
    return removed


_support_cache: dict[str, str | None] = {}


def check_netns_support(use_cache: bool = True) -> str | None:
    """None if shaped namespaces work here, else a human-readable reason.

    Actually creates (and deletes) a throw-away namespace with a tbf qdisc, so it
    also catches restricted containers and missing kernel modules.  The answer
    is cached per process unless ``use_cache=False``.
    """
    if use_cache and "answer" in _support_cache:
        return _support_cache["answer"]
    answer = _probe_support()
    _support_cache["answer"] = answer
    return answer


def _probe_support() -> str | None:
    if not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) not found on PATH"
    try:
        with shaped_namespace(name_prefix="qsdpprobe", rate_mbit=100) as ns:
            if "tbf" not in ns.qdisc_show():
                return "tc qdisc add ... tbf reported success but no tbf qdisc is installed"
            out = ns.run(["ip", "link", "show", "dev", "lo"], capture_output=True, text=True)
            if out.returncode != 0 or "UP" not in out.stdout:
                return f"could not bring up loopback in a namespace: {out.stderr.strip()}"
    except NetnsError as e:
        return f"cannot create a shaped network namespace: {e}"
    except OSError as e:
        return f"cannot create a shaped network namespace: {e}"
    return None


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m experiments.shelf.netns", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether shaped namespaces work here")
    ls = sub.add_parser("list", help="list namespaces with the prefix")
    ls.add_argument("--prefix", default=DEFAULT_PREFIX)
    cl = sub.add_parser("cleanup", help="delete leftover namespaces with the prefix")
    cl.add_argument("--prefix", default=DEFAULT_PREFIX)
    cl.add_argument("--all", action="store_true", help="also those whose owner is alive")
    args = p.parse_args(argv)
    if args.cmd == "check":
        reason = check_netns_support(use_cache=False)
        print("ok" if reason is None else f"unsupported: {reason}")
        return 0 if reason is None else 1
    if args.cmd == "list":
        print("\n".join(list_namespaces(args.prefix)))
        return 0
    removed = cleanup_stale(args.prefix, only_dead_owners=not args.all)
    print("\n".join(f"removed {n}" for n in removed) or "nothing to remove")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())


@contextlib.contextmanager
def veth_namespaces(
    count: int = 2,
    rate_mbit: float | None = None,
    name_prefix: str = DEFAULT_PREFIX,
    mtu: int = 9000,
    burst_kb: float = 512,
    latency_ms: float = 100.0,
) -> Iterator[list[ShapedNamespace]]:
    """``count`` namespaces ("hosts"), each with its own unshaped loopback, joined by veth
    links to a bridge namespace; each host's veth egress is shaped with ``tbf`` at
    ``rate_mbit`` (None: unshaped). Host ``i`` has address ``10.77.0.<i + 1>``
    (``HOST_ADDR.format(i + 1)``).

    Unlike :func:`shaped_namespace` only traffic *between* hosts is shaped (each direction
    of each host link at ``rate_mbit``: a full-duplex link per host), while traffic between
    the devices of one process stays on that host's loopback. Run one process per host
    (``run_processes(netns=[...], extra_env={"QSDP_COORDINATOR_HOST": "10.77.0.1",
    "QSDP_GLOO_HOSTS": "10.77.0.1,10.77.0.2"})``). All namespaces are deleted on exit.
    """
    _validate(rate_mbit, mtu, burst_kb, latency_ms, name_prefix)
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    bridge = f"{name_prefix}-{tag}-br"
    hosts = [f"{name_prefix}-{tag}-h{i}" for i in range(count)]
    made: list[str] = []
    with raise_on_sigterm():
        try:
            for name in [bridge, *hosts]:
                _run(["ip", "netns", "add", name])
                made.append(name)
                _run(["ip", "netns", "exec", name, "ip", "link", "set", "dev", "lo", "up"])
            br = ["ip", "netns", "exec", bridge]
            _run(br + ["ip", "link", "add", "br0", "type", "bridge"])
            _run(br + ["ip", "link", "set", "br0", "up"])
            for i, name in enumerate(hosts):
                h = ["ip", "netns", "exec", name]
                a, b = f"qv{i}a{tag[-4:]}", f"qv{i}b{tag[-4:]}"
                _run(["ip", "link", "add", a, "mtu", str(mtu), "type", "veth", "peer", "name", b, "mtu", str(mtu)])
                _run(["ip", "link", "set", a, "netns", name])
                _run(["ip", "link", "set", b, "netns", bridge])
                _run(h + ["ip", "addr", "add", f"{HOST_ADDR.format(i + 1)}/24", "dev", a])
                _run(h + ["ip", "link", "set", a, "up"])
                _run(br + ["ip", "link", "set", b, "master", "br0"])
                _run(br + ["ip", "link", "set", b, "up"])
                if rate_mbit is not None:
                    _run(
                        h
                        + [
                            "tc",
                            "qdisc",
                            "add",
                            "dev",
                            a,
                            "root",
                            "tbf",
                            "rate",
                            _tc_rate(float(rate_mbit)),
                            "burst",
                            f"{_tc_num(burst_kb)}kb",
                            "latency",
                            f"{_tc_num(latency_ms)}ms",
                        ]
                    )
            yield [
                ShapedNamespace(name=n, rate_mbit=rate_mbit, mtu=mtu, burst_kb=burst_kb, latency_ms=latency_ms)
                for n in hosts
            ]
        finally:
            for name in reversed(made):
                _delete(name)


HOST_ADDR = "10.77.0.{}"
