"""The trainer's mesh and multi-process flags: ``--mesh``, per-level bits, ``jax.distributed``.

    --mesh fsdp                  1-D FSDP over all devices (the default)
    --mesh node=2,local=4        hierarchical FSDP: sharded over both axes, two-stage collectives
    --mesh node,local            the same with node = number of processes (hosts), local = the rest
    --mesh replica=2,fsdp=4      hybrid: sharded inside a group of 4, replicated over 2 groups
    --inter-weight-bits / --inter-grad-bits   bits on the outer (inter-node / cross-group) level
    --coordinator HOST:PORT --num-processes N --process-id I   (or QSDP_* variables; SLURM and
                                 TPU pods are detected by JAX itself)
    --init-timeout S --peer-timeout S   bounds on the processes meeting at start, and on noticing
                                 a lost process during the run (qsdp_jax._src.distributed.peers)

Errors are ``ValueError`` with a message naming the flag; the CLI turns them into usage errors.
This module imports no jax at the top (the device flags must be set before jax starts).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from experiments.gpt.arg_types import nonnegative_int, parse_bits, positive_float, positive_int

OUTER_AXES = {"node": "node_axis", "replica": "replica_axis"}


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Add the mesh / per-level bits / distributed flags to ``p``."""
    g = p.add_argument_group("mesh / cluster")
    g.add_argument(
        "--mesh",
        default="fsdp",
        metavar="SPEC",
        help="fsdp (1-D, default), node=2,local=4 (hierarchical FSDP, two-stage "
        "collectives) or replica=2,fsdp=4 (hybrid sharding); sizes may be left out "
        "(node,local): the outer one is then the number of processes",
    )
    g.add_argument(
        "--inter-weight-bits",
        type=parse_bits,
        default=None,
        metavar="{1..8,none}",
        help="weight bits on the outer level (default: --weight-bits); 2-D meshes only",
    )
    g.add_argument(
        "--inter-grad-bits",
        type=parse_bits,
        default=None,
        metavar="{1..8,none}",
        help="gradient bits on the outer level (default: --grad-bits); 2-D meshes only",
    )
    g.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address for jax.distributed (or QSDP_COORDINATOR; not "
        "needed under SLURM srun or on a TPU pod)",
    )
    g.add_argument(
        "--num-processes", type=positive_int, default=None, help="number of processes (or QSDP_NUM_PROCESSES)"
    )
    g.add_argument(
        "--process-id", type=nonnegative_int, default=None, help="this process's id, 0..N-1 (or QSDP_PROCESS_ID)"
    )
    g.add_argument(
        "--process-logs", type=Path, default=None, metavar="DIR", help="every process logs to DIR/process_<i>.log"
    )
    g.add_argument(
        "--init-timeout",
        type=positive_int,
        default=None,
        metavar="S",
        help="seconds the processes wait for each other at start, then each says "
        "what is wrong and exits with status 69 (or QSDP_INIT_TIMEOUT_S; default 60)",
    )
    g.add_argument(
        "--peer-timeout",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="a process that dies or exits early ends the others at once, one that "
        "sends no heartbeat for S seconds (frozen, network down) after S: each says "
        "which process and exits with status 75 (default: 10)",
    )


def parse_mesh(spec: str) -> tuple[tuple[str, int | None], ...]:
    """``"node=2,local=4"`` -> ``(("node", 2), ("local", 4))``; a size may be left out (None)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--mesh {spec!r}: expected e.g. fsdp, node=2,local=4 or replica=2,fsdp=4")
    axes: list[tuple[str, int | None]] = []
    for part in spec.split(","):
        name, _, size = part.strip().partition("=")
        name = name.strip()
        if not name or not name.replace("_", "").isalnum():
            raise ValueError(f"--mesh {spec!r}: {part!r} is not an axis name")
        if size.strip() in ("", "auto"):
            axes.append((name, None))
        elif size.strip().isdigit() and int(size) > 0:
            axes.append((name, int(size)))
        else:
            raise ValueError(f"--mesh {spec!r}: size {size!r} of axis {name!r} must be a positive integer or left out")
    if len({n for n, _ in axes}) != len(axes):
        raise ValueError(f"--mesh {spec!r}: an axis name appears twice")
    if len(axes) > 2:
        raise ValueError(f"--mesh {spec!r}: at most two axes (outer, inner)")
    if len(axes) == 2 and axes[0][0] not in OUTER_AXES:
        raise ValueError(
            f"--mesh {spec!r}: unknown outer axis {axes[0][0]!r}; use node (hierarchical FSDP, "
            "e.g. node=2,local=4) or replica (hybrid sharding, e.g. replica=2,fsdp=4)"
        )
    return tuple(axes)


def mesh_config_kwargs(spec: str) -> dict:
    """The QSDPConfig fields the mesh implies: ``axis_name`` and ``node_axis``/``replica_axis``."""
    axes = parse_mesh(spec)
    kw = {"axis_name": axes[-1][0]}
    if len(axes) == 2:
        kw[OUTER_AXES[axes[0][0]]] = axes[0][0]
    return kw


def mesh_sizes(spec: str, num_devices: int, num_processes: int) -> tuple[tuple[str, int], ...]:
    """The mesh of ``spec`` with every size filled in for ``num_devices`` devices; () for 1-D.

    A left-out outer size is the number of processes (one node per host); a left-out inner
    size is what remains. ValueError when the sizes do not multiply to the device count."""
    axes = parse_mesh(spec)
    if len(axes) == 1:
        if axes[0][1] not in (None, num_devices):
            raise ValueError(f"--mesh {spec}: the 1-D mesh spans all {num_devices} devices")
        return ()
    (outer, o), (inner, i) = axes
    if o is None and i is None:
        if num_processes == 1:
            raise ValueError(
                f"--mesh {spec}: give the sizes with one process, e.g. {outer}=2,{inner}={max(1, num_devices // 2)}"
            )
        o = num_processes
    if o is None:
        assert i is not None  # both left out is handled just above
        o = num_devices // i if num_devices % i == 0 else 0
    if i is None:
        i = num_devices // o if num_devices % o == 0 else 0
    if not o or not i or o * i != num_devices:
        raise ValueError(
            f"--mesh {spec}: {num_devices} devices do not factor into {outer} x {inner}"
            + (f" = {o} x {i}" if o and i else "")
            + "; the sizes must multiply to the device count"
        )
    return ((outer, o), (inner, i))


def start_distributed(args: argparse.Namespace):
    """Start ``jax.distributed`` from the flags and the environment (no-op for one process)."""
    from qsdp_jax import distributed

    heartbeat = None  # JAX's own heartbeat timeout: above --peer-timeout, so that ours comes first
    if not os.environ.get(distributed.ENV_HEARTBEAT):
        heartbeat = max(10, math.ceil(args.peer_timeout) + 10)
    info = distributed.initialize(
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        init_timeout_s=args.init_timeout,
        heartbeat_timeout_s=heartbeat,
    )
    if args.process_logs is not None:
        distributed.enable_process_log(args.process_logs)
    return info
