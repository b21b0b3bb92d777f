"""The environment of a test's ``jax.distributed`` child processes, started by QSDP_* variables
alone: nothing of this session's QSDP_* settings or of a cluster JAX could detect leaks in."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLUSTER_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_STEP_NUM_NODES",
    "OMPI_MCA_orte_hnp_uri",
    "KUBERNETES_SERVICE_HOST",
    "JAX_COORDINATOR_ADDRESS",
)


def process_env(port: int, devices: int, **qsdp: str) -> dict[str, str]:
    """This environment without QSDP_* and cluster variables, plus CPU JAX with ``devices``
    simulated devices, the repository on the path, a coordinator at ``127.0.0.1:port``, and
    ``QSDP_<NAME>`` for each keyword (``num_processes="2"`` -> ``QSDP_NUM_PROCESSES=2``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QSDP_") and k not in CLUSTER_VARS}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        QSDP_COORDINATOR=f"127.0.0.1:{port}",
    )
    env.update({f"QSDP_{name.upper()}": value for name, value in qsdp.items()})
    return env
