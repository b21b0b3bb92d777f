"""Where :mod:`qsdp_jax.distributed` finds its settings: the ``QSDP_*`` environment variables,
and the cluster environments JAX detects by itself (SLURM, Open MPI, Cloud TPU...).

:func:`settings_from_env` reads the variables (``DistributedSettings.from_env``);
:func:`detect_cluster` and :func:`cluster_count` ask JAX's own cluster classes (those behind
``jax.distributed.initialize()``) which cluster this is and how many processes it has
(``qsdp_jax.distributed.resolve``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ENV_COORDINATOR = "QSDP_COORDINATOR"
ENV_NUM_PROCESSES = "QSDP_NUM_PROCESSES"
ENV_PROCESS_ID = "QSDP_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "QSDP_LOCAL_DEVICE_IDS"
ENV_HEARTBEAT = "QSDP_HEARTBEAT_TIMEOUT_S"
ENV_SHUTDOWN = "QSDP_SHUTDOWN_TIMEOUT_S"
ENV_INIT = "QSDP_INIT_TIMEOUT_S"
ENV_SERVICE_HELPER = "QSDP_SERVICE_HELPER"
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def settings_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The ``DistributedSettings`` fields the variables of ``env`` give.

    Always ``coordinator`` (``QSDP_COORDINATOR``, else ``JAX_COORDINATOR_ADDRESS``),
    ``num_processes``, ``process_id`` and ``local_device_ids`` (None where unset or empty); the
    timeouts and ``service_helper`` only where their variable is set.

    Raises:
      ValueError: a variable that is not an integer (a list of integers for the device ids, a
        boolean for ``QSDP_SERVICE_HELPER``).
    """
    fields: dict[str, Any] = dict(
        coordinator=env.get(ENV_COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS") or None,
        num_processes=env_int(env, ENV_NUM_PROCESSES),
        process_id=env_int(env, ENV_PROCESS_ID),
        local_device_ids=env_ids(env, ENV_LOCAL_DEVICE_IDS),
    )
    for name, var in (
        ("heartbeat_timeout_s", ENV_HEARTBEAT),
        ("shutdown_timeout_s", ENV_SHUTDOWN),
        ("init_timeout_s", ENV_INIT),
    ):
        value = env_int(env, var)
        if value is not None:
            fields[name] = value
    raw = env.get(ENV_SERVICE_HELPER, "").strip()
    if raw:
        if raw.lower() not in _BOOLS:
            raise ValueError(f"environment variable {ENV_SERVICE_HELPER}={raw!r} is invalid: must be 1 or 0")
        fields["service_helper"] = _BOOLS[raw.lower()]
    return fields


def detect_cluster(cluster_detection: str | None = None) -> str | None:
    """The name of the cluster environment JAX's own detection finds here, or None.

    Uses the cluster classes behind ``jax.distributed.initialize()``; the Cloud TPU check
    only talks to the metadata server when running on a Cloud TPU VM."""
    if cluster_detection == "deactivate":
        return None
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - private module moved: let jax decide alone
        return None
    for env in clusters.ClusterEnv._cluster_types:
        if cluster_detection is not None and env.name != cluster_detection:
            continue
        if cluster_detection is None and env.opt_in_only_method:
            continue
        try:
            if env.is_env_present():
                return env.name
        except Exception:  # noqa: BLE001 - a broken detector is "not this cluster"
            continue
    return None


def cluster_count(cluster: str) -> int | None:
    """The process count the detected ``cluster`` reports, or None when unknown until jax
    starts."""
    try:
        from jax._src import clusters

        env = next(e for e in clusters.ClusterEnv._cluster_types if e.name == cluster)
        return int(env.get_process_count())
    except Exception:  # noqa: BLE001 - unknown until jax starts
        return None


def env_int(env: Mapping[str, str], var: str) -> int | None:
    """The integer value of ``var``, or None when it is unset or empty.

    Raises:
      ValueError: naming the variable, when its value is not an integer.
    """
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} is invalid: must be an integer") from None


def env_ids(env: Mapping[str, str], var: str) -> tuple[int, ...] | None:
    """The comma-separated device ids of ``var`` (``0,1,2,3``), or None when it is unset or empty.

    Raises:
      ValueError: naming the variable, when its value is not comma-separated integers.
    """
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        return tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(
            f"environment variable {var}={raw!r} is invalid: must be comma-separated device ids such as 0,1,2,3"
        ) from None
