"""JAX's coordination service hosted by a helper process of process 0, which outlives it.

``jax.distributed.initialize`` starts the coordination service inside process 0. When process 0
dies, every other process's JAX client loses the service and JAX aborts it from C++ at once
(status 134 and a stack trace, about 0.1 s later), racing the peer monitor of
:mod:`qsdp_jax._src.distributed.peers`, whose message and status 75 came first only in practice.

Hosted by a helper process instead, the service outlives process 0 and treats its death as any
other process's: as missed heartbeats, after ``heartbeat_timeout_s``. The peer monitor sees the
closed connection at once, so its message and status come first by construction, by the margin
of the heartbeat timeout. Process 0 still passes jax a bind address for its own service (jax
always starts one there): a free loopback port that no process connects to.

The helper (this file run as a script, so that nothing of ``qsdp_jax`` or a JAX backend starts
in it; ``-P`` keeps its folder off the import path) starts the service, prints ``ready`` and
reads its standard input. ``done`` (written by :meth:`ServiceHost.stop`, once process 0 has shut
``jax.distributed`` down, so every process has passed jax's shutdown barrier) stops the service
at once. The end of its input without ``done`` (process 0 exited or died) stops it ``linger_s``
later: time for the others to see process 0 gone and end on their own. Its output reaches
process 0's standard error through a pipe, so it never holds process 0's own output open.

Schedulers stop a job by signalling process groups (SLURM's ``scancel``, preemption and time
limit, ``timeout``, systemd, most launchers): the helper runs in a session of its own, so a
signal to process 0's group does not reach it, and it ignores SIGTERM, SIGINT and SIGHUP
whatever sends them. So a SIGTERM leaves the service up while the trainers save their
checkpoint together and leave (a helper killed by it aborted every trainer from C++, status 134,
before their handlers could save), and a SIGKILL to process 0's group leaves the service to
report process 0's death as missed heartbeats, after the peer monitor's message. It still ends
with process 0: on ``done``, or ``linger_s`` after process 0's end closes its input.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time

READY = "ready"
DONE = "done"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # ignored by the helper


class ServiceHost:
    """A running helper process that hosts JAX's coordination service (see the module docstring).

    Args:
      proc: the helper process, started by :meth:`start`.
    """

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(
        cls,
        bind_address: str,
        num_processes: int,
        *,
        heartbeat_timeout_s: int,
        shutdown_timeout_s: int,
        linger_s: float,
        recoverable: bool = False,
        ready_timeout_s: float = 60.0,
    ) -> "ServiceHost":
        """Start the helper and wait until its service listens on ``bind_address``.

        Args:
          bind_address: where the service listens (``[::]:port``, as jax's default).
          num_processes: the number of processes of the run.
          heartbeat_timeout_s: seconds without a heartbeat after which the service counts a
            process as dead.
          shutdown_timeout_s: seconds the service waits for the processes at shutdown.
          linger_s: seconds the service stays up once process 0 is gone without :meth:`stop`.
          recoverable: jax's ``jax_enable_recoverability`` (passed on to the service).
          ready_timeout_s: seconds to wait for the service to listen.

        Returns:
          The started host.

        Raises:
          RuntimeError: the helper exited or did not say it was ready in time (its own
            output, above the error, says why).
        """
        argv = [sys.executable, "-P", __file__, bind_address, str(num_processes), str(heartbeat_timeout_s)]
        argv += [str(shutdown_timeout_s), str(linger_s), "1" if recoverable else "0"]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            close_fds=True,
            start_new_session=True,  # out of process 0's process group: the job's signals miss it
        )
        ready = threading.Event()
        threading.Thread(target=_relay, args=(proc, ready), name="qsdp-service-host-output", daemon=True).start()
        deadline = time.monotonic() + ready_timeout_s
        while not ready.wait(timeout=0.05) and proc.poll() is None and time.monotonic() < deadline:
            pass
        if not ready.is_set():
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"JAX's coordination service did not start on {bind_address} within {ready_timeout_s:g} s "
                f"in its helper process (status {proc.returncode}; its output is above). Set "
                "DistributedSettings(service_helper=False) (QSDP_SERVICE_HELPER=0) to host it in "
                "process 0, as jax does"
            )
        return cls(proc)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the service now (every process is past jax's shutdown) and wait for the helper."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(DONE + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _relay(proc: subprocess.Popen, ready: threading.Event) -> None:
    """The helper's output on this process's stderr; ``ready`` set when it says it listens."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if not ready.is_set() and line.strip() == READY:
            ready.set()
        else:
            sys.stderr.write(line)


def main(argv: list[str] | None = None) -> None:
    """The helper: host the service until ``done``, or ``linger_s`` after its input ends."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bind_address")
    p.add_argument("num_processes", type=int)
    p.add_argument("heartbeat_timeout_s", type=int)
    p.add_argument("shutdown_timeout_s", type=int)
    p.add_argument("linger_s", type=float)
    p.add_argument("recoverable", type=int, choices=(0, 1))
    a = p.parse_args(argv)
    for sig in STOP_SIGNALS:  # the trainers save and leave first; process 0's end ends this one
        signal.signal(sig, signal.SIG_IGN)
    from jax._src.lib import _jax  # jax's own constructor of the service (no backend starts)

    service = _jax.get_distributed_runtime_service(
        a.bind_address,
        a.num_processes,
        heartbeat_timeout=a.heartbeat_timeout_s,
        shutdown_timeout=a.shutdown_timeout_s,
        recoverable=bool(a.recoverable),
    )
    print(READY, flush=True)
    if sys.stdin.readline().strip() != DONE:
        time.sleep(a.linger_s)  # process 0 is gone: the others see it first, then we go
    service.shutdown()


if __name__ == "__main__":
    main()
