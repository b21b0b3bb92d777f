"""Launch N cooperating JAX CPU processes (jax.distributed + gloo) and collect results.

    from experiments.shelf.multiproc import run_processes
    from experiments.shelf.netns import shaped_namespace

    with shaped_namespace(rate_mbit=1000) as ns:
        res = run_processes("experiments.bench.allgather_probe", "allgather_probe",
                            num_processes=2, kwargs={"num_bytes": 16 << 20},
                            netns=ns)

Each child is ``[ip netns exec NS] python -m experiments.shelf.multiproc --worker ...``
with ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=<devices_per_process>`` (the
parent's own device-count flag is stripped, so a parent running with 8 fake
devices - like the test suite - does not leak it).  The worker

  1. imports ``module`` and resolves ``func`` (fails fast, before any network),
  2. selects gloo CPU collectives and calls ``jax.distributed.initialize(
     coordinator_address="127.0.0.1:<port>", num_processes=N, process_id=i)``,
  3. calls ``func(**kwargs)``, which must return a JSON-serialisable dict
     (numpy scalars/arrays are converted), and writes it as JSON to its result file (a file
     of its own, not stdout: gloo's C++ logging writes to stdout from the same process at any
     moment, and once landed inside a result printed there),
  4. shuts the distributed runtime down.

The target module must not touch JAX devices at import time (initialize() must
come first).  Inside ``func`` the usual multi-controller rules apply: every
process must issue the same collectives in the same order.

The parent returns the dicts ordered by process id.  If any child exits non-zero
(or without a result file), or the timeout passes, or the parent is interrupted
(KeyboardInterrupt, SIGTERM), every child's process group is SIGKILLed and reaped
before ``WorkerError`` (``WorkerTimeout`` on timeout) is raised with the stderr
tail of the failed child(ren).  Workers also set PR_SET_PDEATHSIG=SIGKILL, so
they die if the parent is SIGKILLed.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.shelf.netns import raise_on_sigterm

__all__ = [
    "WorkerError",
    "WorkerTimeout",
    "find_free_port",
    "run_processes",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
_TAIL_CHARS = 4000
_POLL_S = 0.02
# How long the other workers get, after one fails, to exit by themselves and report their own
# errors (see _await_exits), before they are killed.
_FAILURE_GRACE_S = 5.0


class WorkerError(RuntimeError):
    """A worker process failed.  ``stderr_tails`` maps process id -> stderr tail."""

    def __init__(self, message: str, *, returncodes=None, stderr_tails=None, pids=(), run_id=""):
        super().__init__(message)
        self.returncodes: dict[int, int | None] = dict(returncodes or {})
        self.stderr_tails: dict[int, str] = dict(stderr_tails or {})
        self.pids: tuple[int, ...] = tuple(pids)
        self.run_id: str = run_id


class WorkerTimeout(WorkerError, TimeoutError):
    """The workers did not all finish within ``timeout_s``."""


# --------------------------------------------------------------------------- ports


def find_free_port(netns: str | None = None, host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (in namespace ``netns`` if given).

    There is an unavoidable race between this and the coordinator binding it;
    ``run_processes`` retries once with a new port on "address in use".
    """
    if netns is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    code = "import socket;s=socket.socket();s.bind(('%s',0));print(s.getsockname()[1])" % host
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        raise WorkerError(f"could not pick a port inside netns {netns!r}: {out.stderr.strip()}")
    return int(out.stdout.strip())


# --------------------------------------------------------------------------- parent


@dataclasses.dataclass
class _Child:
    process_id: int
    popen: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    result_path: Path
    killed: bool = False

    def read(self, which: str) -> str:
        path = self.stdout_path if which == "stdout" else self.stderr_path
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, which: str = "stderr", n: int = _TAIL_CHARS) -> str:
        text = self.read(which)
        return text if len(text) <= n else "...\n" + text[-n:]


def _die_with_parent(parent_pid: int) -> None:
    """In a worker: get SIGKILLed when the launching process dies (Linux only).

    Done in the worker rather than as a Popen ``preexec_fn``: a preexec_fn forces
    a plain fork() of the (multi-threaded, jax-importing) parent, which can
    deadlock; without it CPython can use vfork/posix_spawn.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort (non-Linux)
        return
    if parent_pid > 0 and os.getppid() != parent_pid:  # parent died before prctl
        os._exit(1)


def _kill_all(children: Sequence[_Child]) -> None:
    """SIGKILL every child's process group and reap them.

    SIGKILL straight away: after jax.distributed.initialize() the workers have a
    SIGTERM handler (jax's preemption notifier) and ignore a polite SIGTERM.
    Workers hold no state worth a graceful exit (their files belong to us).
    """
    for c in children:
        # Only signal groups whose leader is not reaped yet: a reaped pid (and
        # so its group id) could belong to someone else by now.
        if c.popen.poll() is None:
            c.killed = True
            try:
                os.killpg(c.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for c in children:
        try:
            c.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass


_FLAG_RE = re.compile(r"--xla_force_host_platform_device_count=\S*|--xla_cpu_multi_thread_eigen=\S*")


def _child_env(devices_per_process: int, threads: int, extra_env: Mapping[str, str] | None) -> dict:
    env = dict(os.environ)
    flags = _FLAG_RE.sub("", env.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    if threads == 1:
        flags.append("--xla_cpu_multi_thread_eigen=false")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + pp if pp else "")
    if extra_env:
        env.update({str(k): str(v) for k, v in extra_env.items()})
    return env


def _parse_result(child: _Child) -> dict:
    try:
        text = child.result_path.read_text()
    except FileNotFoundError:
        raise ValueError(f"no result file {child.result_path.name}") from None
    return json.loads(text)


def _describe(children: Sequence[_Child], failed: Sequence[_Child], header: str) -> tuple[str, dict]:
    parts = [header]
    tails = {}
    for c in failed:
        t = c.tail("stderr")
        if not t.strip():
            t = "(stderr empty; stdout tail follows)\n" + c.tail("stdout")
        tails[c.process_id] = t
        parts.append(f"--- process {c.process_id} (rc={c.popen.returncode}) stderr tail ---\n{t.rstrip()}")
    states = ", ".join(
        f"p{c.process_id}: rc={c.popen.returncode}{' (killed by us)' if c.killed else ''}" for c in children
    )
    parts.append(f"--- all: {states}")
    return "\n".join(parts), tails


def _error(
    cls: type[WorkerError], children: Sequence[_Child], failed: Sequence[_Child], header: str, run_id: str
) -> WorkerError:
    """The ``cls`` error for a run whose ``failed`` children are described under ``header``."""
    msg, tails = _describe(children, failed, header)
    return cls(
        msg,
        returncodes={c.process_id: c.popen.returncode for c in children},
        stderr_tails=tails,
        pids=[c.popen.pid for c in children],
        run_id=run_id,
    )


def run_processes(
    module: str,
    func: str,
    num_processes: int,
    kwargs: Mapping[str, Any] | None = None,
    devices_per_process: int = 1,
    netns: Any = None,
    timeout_s: float = 120.0,
    port: int | None = None,
    *,
    threads_per_process: int | None = None,
    extra_env: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> list[dict]:
    """Run ``module.func(**kwargs)`` in ``num_processes`` jax.distributed CPU processes.

    Args:
      module, func: importable module path and function name; ``func`` must
        return a JSON-serialisable dict.
      num_processes: number of processes (>= 1); global device count is
        ``num_processes * devices_per_process``.
      kwargs: JSON-serialisable keyword arguments, same for every process
        (use ``jax.process_index()`` inside for per-process behaviour).
      devices_per_process: fake CPU devices per process.
      netns: namespace name or an object with ``.name`` (``ShapedNamespace``);
        None runs in the current namespace.
      timeout_s: wall-clock limit for the whole run, including startup.
      port: coordinator port on 127.0.0.1; None picks a free one (inside
        ``netns`` when given) and retries once if it got taken meanwhile.
      threads_per_process: OMP/BLAS threads per child; default
        ``max(1, os.cpu_count() // num_processes)``; with 1, XLA's Eigen
        multi-threading is also disabled to avoid oversubscription.
      extra_env: extra environment variables for the children (override ours).
      python: interpreter for the children.

    Returns one dict per process, ordered by process id.
    Raises WorkerError / WorkerTimeout; no child survives any exit path.
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if isinstance(devices_per_process, bool) or not isinstance(devices_per_process, int) or devices_per_process < 1:
        raise ValueError(f"devices_per_process must be an int >= 1, got {devices_per_process!r}")
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    kwargs = dict(kwargs or {})
    kwargs_json = json.dumps(kwargs)  # fail early on non-serialisable kwargs
    ns_name = getattr(netns, "name", netns)
    if isinstance(netns, (list, tuple)):  # one namespace per process (see _worker_main)
        if len(netns) != num_processes:
            raise ValueError(f"netns holds {len(netns)} namespaces for {num_processes} processes")
        ns_name = tuple(getattr(x, "name", x) for x in netns)
    if ns_name is not None and shutil.which("ip") is None:
        raise WorkerError("netns given but 'ip' is not on PATH")
    if threads_per_process is None:
        threads_per_process = max(1, (os.cpu_count() or 1) // num_processes)

    attempts = 1 if port is not None else 2
    for attempt in range(attempts):
        coord_ns = ns_name[0] if isinstance(ns_name, tuple) else ns_name
        coord_host = dict(extra_env or {}).get("QSDP_COORDINATOR_HOST", "127.0.0.1")
        use_port = port if port is not None else find_free_port(coord_ns, coord_host)
        try:
            return _run_once(
                module,
                func,
                num_processes,
                kwargs_json,
                devices_per_process,
                ns_name,
                timeout_s,
                use_port,
                threads_per_process,
                extra_env,
                python,
            )
        except WorkerError as e:
            # a taken coordinator port: grpc logs "Failed to add port" and the
            # process segfaults (rc -11) instead of raising
            in_use = any("ddress already in use" in t or "Failed to add port" in t for t in e.stderr_tails.values())
            if attempt + 1 < attempts and in_use and not isinstance(e, WorkerTimeout):
                continue
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _worker_cmd(python, module, func, i, n, port, tmpdir, timeout_s, run_id, netns) -> list[str]:
    """The command line of worker ``i`` of ``n`` (inside ``netns`` when it is not None)."""
    cmd = [python, "-m", "experiments.shelf.multiproc", "--worker", "--module", module, "--func", func]
    cmd += ["--process-id", str(i), "--num-processes", str(n), "--port", str(port)]
    cmd += ["--kwargs-file", str(tmpdir / "kwargs.json"), "--result-file", str(tmpdir / f"p{i}.result.json")]
    cmd += ["--init-timeout", str(max(10, int(timeout_s)))]
    cmd += ["--run-id", run_id, "--parent-pid", str(os.getpid())]
    return cmd if netns is None else ["ip", "netns", "exec", netns, *cmd]


def _await_exits(children: list, grace_s: float) -> None:
    """Wait up to ``grace_s`` for every child to exit by itself (back at once when all have).

    Workers that fail for one cause (a bad function name, a bad argument) fail at moments that
    differ by their start-up time, which on a loaded machine is more than a second apart: a
    fixed 0.1 s wait killed process 0 before its own error (the flake of
    ``test_bad_function_name_raises_with_stderr``, only process 1's stderr reported). A worker
    still running after the grace (blocked on its dead peer) is killed by the caller.
    """
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(c.popen.poll() is None for c in children):
        time.sleep(0.05)


def _run_once(
    module, func, n, kwargs_json, devices, ns_name, timeout_s, port, threads, extra_env, python
) -> list[dict]:
    run_id = uuid.uuid4().hex[:12]
    env = _child_env(devices, threads, extra_env)
    children: list[_Child] = []
    with tempfile.TemporaryDirectory(prefix=f"qsdp-mp-{run_id}-") as tmp, raise_on_sigterm():
        tmpdir = Path(tmp)
        (tmpdir / "kwargs.json").write_text(kwargs_json)
        try:
            for i in range(n):
                ns_i = ns_name[i] if isinstance(ns_name, tuple) else ns_name
                cmd = _worker_cmd(python, module, func, i, n, port, tmpdir, timeout_s, run_id, ns_i)
                out_p, err_p = tmpdir / f"p{i}.out", tmpdir / f"p{i}.err"
                with open(out_p, "wb") as fo, open(err_p, "wb") as fe:
                    popen = subprocess.Popen(
                        cmd,
                        stdout=fo,
                        stderr=fe,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        cwd=str(REPO_ROOT),
                        start_new_session=True,
                    )
                children.append(_Child(i, popen, out_p, err_p, tmpdir / f"p{i}.result.json"))

            deadline = time.monotonic() + timeout_s
            while True:
                rcs = [c.popen.poll() for c in children]
                failed = [c for c, rc in zip(children, rcs) if rc not in (None, 0)]
                if failed:
                    _await_exits(children, _FAILURE_GRACE_S)  # let the others' own failures land
                    failed = [c for c in children if c.popen.poll() not in (None, 0)]
                    _kill_all(children)
                    raise _error(
                        WorkerError,
                        children,
                        failed,
                        f"{len(failed)} of {n} worker(s) of {module}.{func} failed"
                        f" (netns={ns_name}, port={port}, run_id={run_id})",
                        run_id,
                    )
                if all(rc == 0 for rc in rcs):
                    break
                if time.monotonic() > deadline:
                    live = [c for c in children if c.popen.poll() is None]
                    _kill_all(children)
                    raise _error(
                        WorkerTimeout,
                        children,
                        live,
                        f"timeout after {timeout_s}s: {len(live)} of {n} worker(s) of "
                        f"{module}.{func} still running (netns={ns_name}, port={port}, run_id={run_id})",
                        run_id,
                    )
                time.sleep(_POLL_S)

            results, bad = [], []
            for c in children:
                try:
                    results.append(_parse_result(c))
                except (ValueError, json.JSONDecodeError) as e:
                    bad.append((c, e))
            if bad:
                raise _error(
                    WorkerError,
                    children,
                    [c for c, _ in bad],
                    "worker(s) exited 0 without a valid result: " + "; ".join(f"p{c.process_id}: {e}" for c, e in bad),
                    run_id,
                )
            return results
        finally:
            _kill_all(children)  # no-op when all exited; essential on any exception


# --------------------------------------------------------------------------- worker


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):  # numpy / jax arrays and scalars
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def _pin_gloo_to_loopback(host: str = "127.0.0.1") -> None:
    """Make gloo bind/advertise 127.0.0.1 instead of ``gethostname()``'s address.

    jax creates the gloo TCP collectives without a hostname/interface, so gloo
    uses the address the machine's hostname resolves to.  That is 127.0.0.1 on
    some boxes but a real NIC address on others - which does not even exist
    inside a fresh network namespace (only ``lo``).  jax has no public knob for
    it (0.10), so wrap the private factory; if that ever moves, warn and keep
    jax's default.
    """
    try:
        from jax._src import xla_bridge

        orig = xla_bridge._jax.make_gloo_tcp_collectives
        if getattr(orig, "_qsdp_pinned", False):
            return

        def pinned(distributed_client, hostname=None, interface=None):
            if hostname is None and interface is None:
                hostname = host
            return orig(distributed_client=distributed_client, hostname=hostname, interface=interface)

        setattr(pinned, "_qsdp_pinned", True)  # a function attribute mypy cannot declare
        xla_bridge._jax.make_gloo_tcp_collectives = pinned
    except Exception as e:  # noqa: BLE001
        print(f"warning: could not pin gloo to 127.0.0.1 ({e!r}); using jax's default", file=sys.stderr)


def _worker_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="experiments.shelf.multiproc --worker")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--module", required=True)
    p.add_argument("--func", required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kwargs-file", required=True)
    p.add_argument("--result-file", required=True)
    p.add_argument("--init-timeout", type=int, default=120)
    p.add_argument("--run-id", default="")  # only for identifying our processes
    p.add_argument("--parent-pid", type=int, default=0)
    a = p.parse_args(argv)
    _die_with_parent(a.parent_pid)

    with open(a.kwargs_file) as f:
        kwargs = json.load(f)
    mod = importlib.import_module(a.module)
    fn = getattr(mod, a.func, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"module {a.module!r} has no callable {a.func!r}")

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # QSDP_COORDINATOR_HOST / QSDP_GLOO_HOSTS (comma-separated, one per process): addresses
    # for runs with one network namespace per process (experiments.shelf.netns.veth_namespaces)
    coord = os.environ.get("QSDP_COORDINATOR_HOST", "127.0.0.1")
    gloo_hosts = os.environ.get("QSDP_GLOO_HOSTS", "").split(",")
    _pin_gloo_to_loopback(
        gloo_hosts[a.process_id] if len(gloo_hosts) > a.process_id and gloo_hosts[a.process_id] else "127.0.0.1"
    )
    jax.distributed.initialize(
        coordinator_address=f"{coord}:{a.port}",
        # default is "[::]:port" = every interface of the machine; keep it local
        coordinator_bind_address=f"{coord}:{a.port}",
        num_processes=a.num_processes,
        process_id=a.process_id,
        initialization_timeout=a.init_timeout,
    )
    try:
        result = fn(**kwargs)
        if not isinstance(result, dict):
            raise TypeError(f"{a.module}.{a.func} returned {type(result).__name__}, expected dict")
        line = json.dumps(result, default=_json_default)
    except BaseException:  # noqa: BLE001
        # A normal interpreter exit would run jax's atexit distributed shutdown,
        # which waits in a barrier for the other (healthy) processes - for
        # minutes.  Report and leave right away; the parent kills the others.
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    tmp = a.result_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(line)
    os.replace(tmp, a.result_file)  # whole or absent
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        raise SystemExit(_worker_main(sys.argv[1:]))
    print(__doc__)
    raise SystemExit(2)
