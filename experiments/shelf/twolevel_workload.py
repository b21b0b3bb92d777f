"""Per-process workloads on two-level meshes, run by ``experiments.shelf.multiproc.run_processes``.

* :func:`train_losses`: a few steps of a tiny GPT on a given mesh and config; the losses (the
  multi-process equality tests compare 2 processes x 4 devices with 1 process x 8 devices).
* :func:`twolevel_benchmark`: the ``experiments.shelf.network_workload`` benchmark on a
  ``("node", "local")`` mesh with two-level configs, plus the wire bytes per mesh axis of
  every compiled step (``bytes_by_axis``); its result has the shape
  ``experiments.shelf.network_results.assemble_results`` reads.

Configs are given as JSON-friendly specs: ``{"name": "qsdp-W4G8", "inter_grad_bits": 4, ...}``
(``name`` as in ``QSDPConfig.from_name``, the other keys are ``QSDPConfig`` fields). Batches
are a pure function of (seed, step): every process computes the same global batch and
contributes only the rows of its own devices (``jax.make_array_from_callback``).

Only ``jax`` is imported lazily: the worker calls ``jax.distributed.initialize`` first.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # the steps qsdp_jax returns are typed Callable; they forward the jit's ``lower``
    from jax.stages import Wrapped

from experiments.shelf.network_workload import DEFAULT_MODEL, TINY_MODEL, _optimizer, gpt_config
from experiments.shelf.timing import time_alternating

__all__ = [
    "HIER_AXES",
    "TWO_LEVEL_CONFIGS",
    "bytes_by_axis",
    "config_from_spec",
    "train_losses",
    "train_losses_many",
    "twolevel_benchmark",
]

#: the hierarchical mesh of the benchmark: one "node" per process
HIER_AXES = ("node", "local")
_HIER = dict(node_axis="node", axis_name="local")

#: Benchmark configs on the ("node", "local") mesh, table order. "x4" = 4-bit across nodes.
TWO_LEVEL_CONFIGS: dict[str, dict] = {
    "fp32": dict(name="fp32", **_HIER),
    "qsdp-W8G8": dict(name="qsdp-W8G8", **_HIER),
    "qsdp-W8G8-xG4": dict(name="qsdp-W8G8", inter_grad_bits=4, **_HIER),
    "qsdp-W4G8-xG4": dict(name="qsdp-W4G8", inter_grad_bits=4, **_HIER),
}


def config_from_spec(spec: Mapping[str, Any], seed: int = 0):
    """``QSDPConfig.from_name(spec["name"], seed=seed, **other keys)``."""
    from qsdp_jax.config import QSDPConfig

    spec = dict(spec)
    return QSDPConfig.from_name(spec.pop("name"), seed=seed, **spec)


def _mesh(mesh_axes):
    import qsdp_jax as q

    return q.make_mesh(mesh_axes if isinstance(mesh_axes, str) else dict(mesh_axes))


def _batch(mesh, config, step: int, global_batch: int, seq_len: int, vocab: int, seed: int):
    """The global batch of ``step`` (pure function of seed and step), each process filling
    only its own devices' rows."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    rng = np.random.default_rng([seed, step])
    tokens = rng.integers(0, vocab, size=(global_batch, seq_len + 1), dtype=np.int32)
    sharding = NamedSharding(mesh, P(config.batch_axes))
    make = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])  # noqa: E731
    return {"inputs": make(tokens[:, :-1]), "targets": make(tokens[:, 1:])}


def train_losses(
    mesh_axes: Any = "fsdp",
    config: Mapping[str, Any] | None = None,
    steps: int = 3,
    model: Mapping[str, int] | None = None,
    global_batch: int = 8,
    seed: int = 0,
    compiler_options: Mapping[str, Any] | None = None,
) -> dict:
    """Train ``steps`` steps of a tiny GPT; ``{"losses": [...], "grad_norms": [...], ...}``.

    ``mesh_axes``: ``"fsdp"`` (1-D) or ``{"node": 2, "local": 4}``; ``config``: a spec (see the
    module docstring), default fp32 on the mesh's 1-D axis. ``compiler_options`` go to
    ``Lowered.compile`` (tests compile at XLA optimisation level 0).
    """
    import jax
    import numpy as np

    import qsdp_jax as q
    from experiments.gpt.model import GPT  # imports jax: the parent process imports this module without

    mesh = _mesh(mesh_axes)
    cfg = config_from_spec(config or {"name": "fp32"}, seed=seed)
    gcfg = gpt_config(model or TINY_MODEL)
    gpt = GPT(gcfg)
    opt = _optimizer(cfg, lr=3e-3)
    state = q.init_train_state(gpt.init_params(seed), opt, mesh, cfg, stacked=gpt.stacked_groups)
    step_fn = q.make_train_step(gpt.loss, opt, mesh, cfg)
    losses, norms, compiled = [], [], None
    for i in range(steps):
        batch = _batch(mesh, cfg, i, global_batch, gcfg.seq_len, gcfg.vocab_size, seed)
        if compiled is None:
            compiled = cast("Wrapped", step_fn).lower(state, batch).compile(dict(compiler_options or {}) or None)
        state, metrics = compiled(state, batch)
        losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
        norms.append(float(np.asarray(metrics["grad_norm"].addressable_data(0))))
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "mesh": dict(mesh.shape),
        "config": cfg.name,
        "losses": losses,
        "grad_norms": norms,
    }


def train_losses_many(cases: list[Mapping[str, Any]], **kwargs) -> dict:
    """:func:`train_losses` of several ``{"mesh_axes": ..., "config": ...}`` cases in one
    process (one start-up for all): ``{"runs": [result, ...]}``."""
    return {"runs": [train_losses(c["mesh_axes"], c["config"], **kwargs) for c in cases]}


# ----------------------------------------------------------------------------------------------
# Bytes per mesh axis
# ----------------------------------------------------------------------------------------------
def bytes_by_axis(compiled, mesh, detail: bool = False) -> dict[str, float]:
    """Wire bytes per device per step of a compiled step, by the mesh axes its collectives'
    replica groups span (``qsdp_jax.comm.CommReport.by_axis``): ``{"node": ..., "local": ...,
    "node+local": ...}``; a group over all devices counts as ``node+local`` (it crosses
    nodes). ``detail``: keys ``"axes/kind/dtype"``, e.g. ``"node/all-to-all/u8"``.
    """
    from qsdp_jax import comm

    report = comm.comm_report(compiled)
    if not detail:
        return dict(report.by_axis(mesh))
    out: dict[str, float] = {}
    for c in report.collectives:
        key = "+".join(comm.axes_spanned(c.replica_groups, mesh)) or "none"
        key = f"{key}/{c.kind}/{c.dtype}"
        out[key] = out.get(key, 0.0) + c.bytes_on_wire
    return out


# ----------------------------------------------------------------------------------------------
# The shaped-network benchmark on a (node, local) mesh
# ----------------------------------------------------------------------------------------------
def twolevel_benchmark(
    model: Mapping[str, int] | None = None,
    batch_per_process: int = 4,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> dict:
    """Worker entry point: a ``(node = processes, local = devices per process)`` mesh, every
    config compiled once, timed alternately; bytes per step and per mesh axis."""
    import jax
    import numpy as np

    import qsdp_jax as q
    from experiments.gpt.model import GPT  # imports jax: the parent process imports this module without
    from qsdp_jax import comm

    model = dict(DEFAULT_MODEL if model is None else model)
    configs = dict(TWO_LEVEL_CONFIGS if configs is None else configs)
    gcfg = gpt_config(model)
    mesh = q.make_mesh({"node": jax.process_count(), "local": jax.local_device_count()})
    gpt = GPT(gcfg)
    params = gpt.init_params(seed)
    global_batch = batch_per_process * jax.process_count()
    built, t0 = {}, time.perf_counter()
    for name, spec in configs.items():
        cfg = config_from_spec(spec, seed=seed)
        batch = _batch(mesh, cfg, 0, global_batch, gcfg.seq_len, gcfg.vocab_size, seed)
        opt = _optimizer(cfg)
        state = q.init_train_state(params, opt, mesh, cfg, stacked=gpt.stacked_groups)
        t1 = time.perf_counter()
        compiled = cast("Wrapped", q.make_train_step(gpt.loss, opt, mesh, cfg)).lower(state, batch).compile()
        built[name] = dict(state=state, compiled=compiled, batch=batch, compile_s=time.perf_counter() - t1)
    build_s = time.perf_counter() - t0

    def runner(b):
        def run():
            b["state"], b["metrics"] = b["compiled"](b["state"], b["batch"])
            return b["metrics"]

        return run

    timings = time_alternating(
        {n: runner(b) for n, b in built.items()}, repeats=repeats, warmup=warmup, sync=jax.block_until_ready
    )
    n_local = jax.local_device_count()
    out = {}
    for name, b in built.items():
        report = comm.comm_report(b["compiled"])
        r = timings[name].to_dict()
        r.update(
            config=name,
            spec=dict(configs[name]),
            bytes_per_device=float(report.total_bytes),
            bytes_per_process=float(report.total_bytes) * n_local,
            bytes_by_kind_dtype={f"{k}/{d}": v for (k, d), v in report.by_kind_dtype().items()},
            bytes_by_axis=bytes_by_axis(b["compiled"], mesh),
            compile_s=b["compile_s"],
            final_loss=float(np.asarray(b["metrics"]["loss"].addressable_data(0))),
        )
        out[name] = r
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": n_local,
        "mesh": dict(mesh.shape),
        "model": model,
        "n_params": gpt.count_params(),
        "batch_per_process": batch_per_process,
        "global_batch": global_batch,
        "repeats": repeats,
        "warmup": warmup,
        "build_s": build_s,
        "configs": out,
    }
