"""Starting ``jax.distributed`` from the environment, once, and printing from one process.

    from qsdp_jax import distributed
    info = distributed.initialize()          # before any other JAX call
    distributed.main_print("step", 0)        # printed by process 0 only

Where the settings come from, first match wins:

1. Arguments (or a :class:`DistributedSettings`) and the ``QSDP_*`` environment variables:
   ``QSDP_COORDINATOR`` (``host:port`` of process 0), ``QSDP_NUM_PROCESSES``,
   ``QSDP_PROCESS_ID``, ``QSDP_LOCAL_DEVICE_IDS`` (``0,1,2,3``), ``QSDP_HEARTBEAT_TIMEOUT_S``,
   ``QSDP_SHUTDOWN_TIMEOUT_S``, ``QSDP_INIT_TIMEOUT_S``, ``QSDP_SERVICE_HELPER``. jax's own ``JAX_COORDINATOR_ADDRESS``
   counts as a coordinator too.
2. A cluster JAX detects by itself (SLURM ``srun``, Open MPI ``mpirun``, Cloud TPU VMs / GKE):
   ``jax.distributed.initialize()`` fills in whatever is not given.
3. Nothing: one process, and :func:`initialize` is a no-op.

The variables are read and the clusters detected in :mod:`qsdp_jax._src.distributed.cluster_env`;
:func:`main_print` and the per-process log live in :mod:`qsdp_jax._src.distributed.process_output`.

:func:`initialize` is idempotent: a second call (or a call after someone else started
``jax.distributed``) returns the running setup. The heartbeat timeout defaults to
10 s instead of jax's 100 s, so a dead peer does not freeze the others for minutes, and the
start to 60 s instead of 300 s: processes that do not all connect by then each say why (nothing
listens at the coordinator's address, or not every process joined) and exit with status 69
(:func:`qsdp_jax._src.distributed.peers.connect_guard`); a process 0 whose port is taken stops at once.
Process 0 hosts JAX's coordination service in a helper process that outlives it
(``service_helper``), so that its death does not abort the others from C++ before they can say
why; :func:`shutdown` stops the helper, and without it the helper stops
``heartbeat_timeout_s + 10`` s after process 0 exits.

Then :func:`check_agreement` (every process has process 0's settings, or all raise naming the
difference) and :func:`watch_peers` (a process that dies, freezes or exits early ends the others
with a message naming it, status 75), for any training loop::

    distributed.check_agreement({"lr": lr, "seed": seed, "steps": steps})
    with distributed.watch_peers(timeout_s=10):
        train()

:class:`StopVote` makes every process stop after the same step when any of them is asked to
(a scheduler's SIGTERM reaches the processes of a job at slightly different moments), so that
all save the same checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping

from qsdp_jax._src.distributed import peers
from qsdp_jax._src.distributed import service_host
from qsdp_jax._src.distributed.agreement import (  # noqa: F401  (part of this module's API)
    AgreementTimeout,
    SettingsMismatch,
    agree_on_error,
    check_agreement,
    from_process_0,
)
from qsdp_jax._src.distributed.cluster_env import (  # noqa: F401  (the variables' names: part of this module's API)
    ENV_COORDINATOR,
    ENV_HEARTBEAT,
    ENV_INIT,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_SERVICE_HELPER,
    ENV_SHUTDOWN,
    cluster_count,
    detect_cluster,
    settings_from_env,
)
from qsdp_jax._src.distributed.stop_vote import StopVote  # noqa: F401  (part of this module's API)
from qsdp_jax._src.distributed.process_output import (  # noqa: F401  (part of this module's API)
    enable_process_log,
    is_main_process,
    main_print,
    num_processes,
    process_index,
)

__all__ = [
    "AgreementTimeout",
    "DistributedInfo",
    "DistributedSettings",
    "SettingsMismatch",
    "StopVote",
    "agree_on_error",
    "check_agreement",
    "enable_process_log",
    "from_process_0",
    "initialize",
    "is_main_process",
    "main_print",
    "num_processes",
    "process_index",
    "resolve",
    "shutdown",
    "watch_peers",
]


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """How to start ``jax.distributed``; every field may be left unset (``None``).

    Validated at construction; :meth:`from_env` reads the ``QSDP_*`` environment variables.

    Attributes:
      coordinator: ``host:port`` of process 0's coordinator service (e.g. ``"10.0.0.1:1234"``).
      num_processes: number of processes in the job, an integer >= 1.
      process_id: this process's id, ``0 <= process_id < num_processes``.
      local_device_ids: accelerators this process uses (e.g. one GPU per process), a non-empty
        sequence of ids >= 0 (stored as a tuple); None lets jax choose (all local devices, or
        one per process under SLURM/MPI on GPUs).
      heartbeat_timeout_s: seconds without a heartbeat after which a peer counts as dead (an
        integer >= 1, default 10).
      shutdown_timeout_s: seconds a finishing process waits for the others at shutdown (an
        integer >= 1, default 30).
      init_timeout_s: seconds the processes wait for each other at start (an integer >= 1,
        default 60); then each says what is wrong (see
        :func:`qsdp_jax._src.distributed.peers.connect_guard`) and exits with status 69.
      cluster_detection: ``None`` (auto), a jax method name (``"slurm"``, ``"ompi"``,
        ``"gcetpu"``, ``"gketpu"``, ``"mpi4py"``, ``"k8s"``) or ``"deactivate"``.
      service_helper: True (the default): process 0 hosts JAX's coordination service in a
        helper process that outlives it (:mod:`qsdp_jax._src.distributed.service_host`), so that its death
        reaches the others as missed heartbeats, after ``heartbeat_timeout_s``, and not as
        JAX's immediate C++ abort; the peer monitor (:func:`watch_peers`) then ends them first,
        with its message. False: jax's own arrangement (the service inside process 0). Used
        where coordinator, process count and id are known before jax starts (given, or from
        the ``QSDP_*`` variables); with a cluster JAX detects by itself, jax's arrangement.

    Raises:
      ValueError: an invalid field (the message names it, its value and what is allowed).
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    heartbeat_timeout_s: int = 10
    shutdown_timeout_s: int = 30
    init_timeout_s: int = 60
    cluster_detection: str | None = None
    service_helper: bool = True

    def __post_init__(self):
        if self.coordinator is not None:
            host, sep, port = str(self.coordinator).rpartition(":")
            if not isinstance(self.coordinator, str) or not sep or not host or not port.isdigit():
                _fail("coordinator", self.coordinator, "'host:port', e.g. '10.0.0.1:1234'")
        if self.num_processes is not None:
            _check_int("num_processes", self.num_processes, minimum=1)
        if self.process_id is not None:
            _check_int("process_id", self.process_id, minimum=0)
            if self.num_processes is not None and self.process_id >= self.num_processes:
                _fail("process_id", self.process_id, f"smaller than num_processes={self.num_processes}")
        if self.local_device_ids is not None:
            ids = tuple(self.local_device_ids)
            if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                _fail("local_device_ids", self.local_device_ids, "a non-empty sequence of device ids >= 0")
            object.__setattr__(self, "local_device_ids", ids)
        for name in ("heartbeat_timeout_s", "shutdown_timeout_s", "init_timeout_s"):
            _check_int(name, getattr(self, name), minimum=1)
        if not isinstance(self.service_helper, bool):
            _fail("service_helper", self.service_helper, "True or False")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "DistributedSettings":
        """Settings from the ``QSDP_*`` variables of an environment.

        ``QSDP_COORDINATOR`` (else ``JAX_COORDINATOR_ADDRESS``), ``QSDP_NUM_PROCESSES``,
        ``QSDP_PROCESS_ID``, ``QSDP_LOCAL_DEVICE_IDS`` (``0,1,2,3``),
        ``QSDP_HEARTBEAT_TIMEOUT_S``, ``QSDP_SHUTDOWN_TIMEOUT_S``, ``QSDP_INIT_TIMEOUT_S``,
        ``QSDP_SERVICE_HELPER`` (``1``/``0``); an unset or empty variable leaves its field at
        the default.

        Args:
          environ: the variables (default ``os.environ``).
          **overrides: fields of :class:`DistributedSettings`; those that are not None win
            over the environment.

        Returns:
          The settings.

        Raises:
          ValueError: a variable that is not an integer (a list of integers for the device
            ids), or an invalid resulting field.
          TypeError: an override that is not a field.
        """
        fields = settings_from_env(os.environ if environ is None else environ)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """The setup :func:`initialize` chose (or :func:`resolve` would choose).

    Attributes:
      source: ``"single"`` (one process, nothing started), ``"explicit"`` (coordinator, process
        count and id given), a detected cluster's name (``"slurm"``, ``"gcetpu"``...) or
        ``"external"`` (``jax.distributed`` was already running when :func:`initialize` was
        called).
      num_processes: the number of processes; None where only jax knows it (a detected cluster
        before jax starts).
      process_id: this process's index; None where only jax knows it.
      coordinator: the coordinator's ``host:port`` when known, else None.
    """

    source: str
    num_processes: int | None
    process_id: int | None
    coordinator: str | None = None

    @property
    def is_multi_process(self) -> bool:
        """True unless the run is known to have one process (``num_processes`` None counts as
        several)."""
        return self.num_processes is None or self.num_processes > 1


_STATE: dict[str, DistributedInfo | None] = {"info": None}
_HOST: dict[str, service_host.ServiceHost | None] = {"host": None}


def resolve(settings: DistributedSettings | None = None) -> DistributedInfo:
    """What :func:`initialize` would do with ``settings`` (default: from the environment),
    without starting anything. Fields only known once jax starts (a detected cluster's
    process id) are None. Raises ``ValueError`` for an incomplete setup: several processes
    without a coordinator, or a coordinator without process count / id, outside a cluster."""
    s = settings if settings is not None else DistributedSettings.from_env()
    explicit = s.coordinator is not None or (s.num_processes or 1) > 1 or (s.process_id or 0) > 0
    if not explicit:
        cluster = None if s.num_processes == 1 else detect_cluster(s.cluster_detection)
        if cluster is None:
            return DistributedInfo("single", 1, 0)
        return DistributedInfo(cluster, cluster_count(cluster), None)
    if None not in (s.coordinator, s.num_processes, s.process_id):
        return DistributedInfo("explicit", s.num_processes, s.process_id, s.coordinator)
    cluster = detect_cluster(s.cluster_detection)
    if cluster is None and s.coordinator is None:
        raise ValueError(
            f"jax.distributed needs a coordinator: num_processes={s.num_processes}, "
            f"process_id={s.process_id} but no coordinator address was given and no cluster "
            f"(SLURM, MPI, TPU) was detected; set {ENV_COORDINATOR}=host:port (process 0's "
            "address, the same on every process) or pass coordinator="
        )
    if cluster is None:
        missing = [v for n, v in ((s.num_processes, ENV_NUM_PROCESSES), (s.process_id, ENV_PROCESS_ID)) if n is None]
        raise ValueError(
            f"coordinator={s.coordinator!r} is set but {' and '.join(missing)} is not, and no "
            "cluster (SLURM, MPI, TPU) was detected to fill it in"
        )
    return DistributedInfo(cluster, s.num_processes or cluster_count(cluster), s.process_id, s.coordinator)


def initialize(settings: DistributedSettings | None = None, **kwargs) -> DistributedInfo:
    """Start ``jax.distributed`` once from ``settings`` / keyword fields / the environment.

    Call it before any other JAX call (jax refuses to start the distributed runtime after
    its backends exist). A single process is a no-op; once started, a second call returns the
    first call's result (a single process is looked at again: nothing was started). A
    ``jax.distributed`` someone else started is reported as ``source="external"``.

    Args:
      settings: the settings; None (the default): :meth:`DistributedSettings.from_env`.
      **kwargs: :class:`DistributedSettings` fields; they override the environment (or, with
        ``settings``, its fields).

    Returns:
      The :class:`DistributedInfo` of the running setup.

    Raises:
      ValueError: invalid settings or environment variables; an incomplete setup outside a
        cluster (see :func:`resolve`); on process 0, the coordinator's port already in use on
        this host.
      TypeError: a keyword that is not a :class:`DistributedSettings` field.
      RuntimeError: several processes, but JAX's backends already exist in this process.
    """
    import jax

    info = _STATE["info"]
    if info is not None and info.source != "single":
        return info  # started once; a single process started nothing: look again
    if jax.distributed.is_initialized():
        info = _STATE["info"] = DistributedInfo("external", jax.process_count(), jax.process_index())
        return info
    if settings is None:
        settings = DistributedSettings.from_env(**kwargs)
    elif kwargs:
        settings = dataclasses.replace(settings, **kwargs)
    plan = resolve(settings)
    if plan.num_processes == 1:
        info = _STATE["info"] = DistributedInfo("single", 1, 0)
        return info
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "qsdp_jax.distributed.initialize() must run before any other JAX call (jax.devices, "
            "jnp arrays, jit...): JAX's backends already exist in this process"
        )
    known = False
    guard: contextlib.AbstractContextManager = contextlib.nullcontext()
    bind = None  # jax's default bind address for process 0's service
    if plan.coordinator is not None and plan.num_processes is not None and plan.process_id is not None:
        known = True
        if plan.process_id == 0:
            peers.check_port_free(plan.coordinator)  # another process 0 (or program) is there
            if settings.service_helper:
                bind = _start_service_host(settings, plan.coordinator, plan.num_processes)
        guard = peers.connect_guard(plan.coordinator, plan.process_id, plan.num_processes, settings.init_timeout_s)
    try:
        with guard:  # our message before jax's own timeout (a C++ abort that names nothing)
            jax.distributed.initialize(
                coordinator_address=settings.coordinator,
                num_processes=settings.num_processes,
                process_id=settings.process_id,
                local_device_ids=list(settings.local_device_ids) if settings.local_device_ids else None,
                cluster_detection_method=settings.cluster_detection,
                initialization_timeout=settings.init_timeout_s + (30 if known else 0),
                heartbeat_timeout_seconds=settings.heartbeat_timeout_s,
                shutdown_timeout_seconds=settings.shutdown_timeout_s,
                coordinator_bind_address=bind,
            )
    except BaseException:
        _stop_service_host()
        raise
    info = _STATE["info"] = DistributedInfo(
        plan.source, jax.process_count(), jax.process_index(), settings.coordinator or plan.coordinator
    )
    return info


def _start_service_host(settings: DistributedSettings, coordinator: str, num_processes: int) -> str:
    """Start the service's helper process (``settings.service_helper``); returns the bind
    address to give jax for process 0's own service, which no process connects to."""
    import jax

    port = peers.host_port(coordinator)[1]
    _HOST["host"] = service_host.ServiceHost.start(
        os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{port}",  # jax's default bind address
        num_processes,
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        linger_s=settings.heartbeat_timeout_s + 10,
        recoverable=bool(getattr(jax.config, "jax_enable_recoverability", False)),
        ready_timeout_s=max(60.0, settings.init_timeout_s),  # its own start: under load, seconds
    )
    return "127.0.0.1:0"


def _stop_service_host() -> None:
    host, _HOST["host"] = _HOST["host"], None
    if host is not None:
        host.stop()


def watch_peers(timeout_s: float = 10.0, **kwargs) -> "peers.PeerMonitor":
    """Start watching the other processes of the run.

    From now on, a process of the run that dies, freezes (``timeout_s``) or exits early ends
    every process with a message naming it and status 75. Call ``.finish()`` on the result when
    this process is done (or use it as a context manager); a no-op with one process. Give
    :func:`initialize` a heartbeat timeout above ``timeout_s``. Monitoring is best effort: when
    the processes cannot connect, a message says so and nothing is watched.

    Args:
      timeout_s: seconds of silence after which a process counts as frozen or unreachable
        (> 0, default 10; a process whose connection closes is seen at once).
      **kwargs: further :class:`qsdp_jax._src.distributed.peers.PeerMonitor` options: ``exit_code`` (this
        process's status when a peer is lost, default 75) and ``connect_timeout_s`` (how long
        to wait for process 0's port and the connection, default 60).

    Returns:
      The started :class:`qsdp_jax._src.distributed.peers.PeerMonitor`.

    Raises:
      ValueError: ``timeout_s`` is not > 0.
    """
    return peers.PeerMonitor(timeout_s, **kwargs).start()


def shutdown() -> None:
    """Stop ``jax.distributed`` if it runs (waits up to the shutdown timeout for peers)."""
    import jax

    try:
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()
    finally:
        _stop_service_host()  # every process is past jax's shutdown barrier (or it failed)
        _STATE["info"] = None


def _fail(field: str, value, allowed: str):
    raise ValueError(f"DistributedSettings.{field}={value!r} is invalid: must be {allowed}")


def _check_int(field: str, value, *, minimum: int):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(field, value, f"an integer >= {minimum}")
