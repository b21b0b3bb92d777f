"""Per-process workload of ``experiments.bench.network``: time FSDP vs QSDP train steps.

Run by ``experiments.shelf.multiproc.run_processes`` inside jax.distributed workers (one per
process, same code everywhere), or in-process on simulated devices (tests).  Every process:

1. builds the same GPT (explicit dims, random init from the same seed, so the parameters are
   identical on every process) and a 1-D mesh over *all* devices of all processes;
2. for each config (fp32 FSDP, bf16 FSDP, QSDP W8G8, QSDP W4G4 by default) initialises a
   sharded train state and compiles the train step once (``lower(...).compile()``); the same
   compiled executable is used for the byte count (``qsdp_jax.comm.comm_report``) and for the
   timed calls, so what is counted is what is timed;
3. feeds a fixed batch of random tokens (the data does not matter for timing) as one global
   array, each process providing its own rows (``jax.make_array_from_process_local_data``
   with the mesh's batch sharding ``P('fsdp')``);
4. times all configs alternately with ``experiments.shelf.timing.time_alternating`` (warm-up calls
   excluded, medians), carrying each config's donated state through its calls.

Only ``jax`` is imported lazily: this module must not touch devices at import time (the
worker calls ``jax.distributed.initialize`` first).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # the steps qsdp_jax returns are typed Callable; they forward the jit's ``lower``
    from jax.stages import Wrapped

from experiments.shelf.timing import time_alternating

__all__ = [
    "CONFIG_NAMES",
    "DEFAULT_MODEL",
    "TINY_MODEL",
    "BuiltStep",
    "qsdp_config",
    "gpt_config",
    "make_batch",
    "build_steps",
    "network_benchmark",
]

#: The configs the benchmark compares, in table order.
CONFIG_NAMES: tuple[str, ...] = ("fp32", "bf16", "qsdp-W8G8", "qsdp-W4G4")

#: The benchmark model (explicit GPT dims; ~3.2M parameters, see bench.network's docstring).
DEFAULT_MODEL: dict[str, int] = dict(d_model=256, n_layers=4, n_heads=4, seq_len=64, vocab_size=256)
#: A model small enough for tests.
TINY_MODEL: dict[str, int] = dict(d_model=64, n_layers=2, n_heads=2, seq_len=16, vocab_size=256)

AXIS = "fsdp"


def qsdp_config(name: str, *, seed: int = 0):
    """The ``QSDPConfig`` of a benchmark config name (``fp32``, ``bf16``, ``qsdp-WxGy``)."""
    from qsdp_jax.config import QSDPConfig

    return QSDPConfig.from_name(name, seed=seed)


def gpt_config(model: Mapping[str, Any]):
    """``GPTConfig`` from a dict of explicit dims (keys of ``GPTConfig``)."""
    from experiments.gpt.model import GPTConfig  # imports jax: the parent process imports this module without

    return GPTConfig(**dict(model))


def _optimizer(config, lr: float = 1e-3):
    import optax

    from qsdp_jax import optim

    # optim's clip: optax's would clip each device by the norm of its own shards in the step
    base = optax.chain(optim.clip_by_global_norm(1.0), optax.adamw(lr, b2=0.99))
    return optim.qsdp(base, config)


def make_batch(mesh, batch_per_process: int, seq_len: int, vocab_size: int, seed: int = 0) -> dict:
    """A global batch ``{"inputs", "targets"}`` of random tokens, sharded ``P('fsdp')``.

    Each process generates only its own ``batch_per_process`` rows (seeded by its process
    index) and contributes them with ``jax.make_array_from_process_local_data``.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    n_local = len([d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    if batch_per_process <= 0 or batch_per_process % max(1, n_local):
        raise ValueError(
            f"batch_per_process={batch_per_process} must be a positive multiple of the "
            f"{n_local} local device(s) of this process"
        )
    sharding = NamedSharding(mesh, P(AXIS))
    n_proc = len({d.process_index for d in mesh.devices.flat})
    rng = np.random.default_rng([seed, jax.process_index()])
    tokens = rng.integers(0, vocab_size, size=(batch_per_process, seq_len + 1), dtype=np.int32)
    global_shape = (batch_per_process * n_proc, seq_len)
    return {
        "inputs": jax.make_array_from_process_local_data(sharding, tokens[:, :-1], global_shape),
        "targets": jax.make_array_from_process_local_data(sharding, tokens[:, 1:], global_shape),
    }


@dataclasses.dataclass
class BuiltStep:
    """One config's compiled step, its current state and its communication volume."""

    name: str
    compiled: Any  # jax.stages.Compiled: (state, batch) -> (state, metrics), donates state
    state: Any
    bytes_per_device: float  # wire bytes one device sends per step (comm_report)
    bytes_by_kind_dtype: dict
    compile_s: float
    init_s: float

    def step(self, batch):
        """Run one step, carrying the (donated) state; returns ``(state, metrics)``."""
        self.state, metrics = self.compiled(self.state, batch)
        return self.state, metrics


def build_steps(
    model: Mapping[str, int],
    mesh,
    batch,
    configs: Sequence[str] = CONFIG_NAMES,
    seed: int = 0,
    compiler_options: Mapping[str, Any] | None = None,
) -> dict[str, BuiltStep]:
    """Initialise and compile the train step of every config on ``mesh`` (same params).

    The parameters are created from ``seed`` (identical on every process); each config gets
    its own sharded copy (steps donate their input state).  ``compiler_options`` go to
    ``Lowered.compile`` (tests pass ``{"xla_backend_optimization_level": 0}`` to compile
    faster; the benchmark uses XLA's defaults).
    """
    import qsdp_jax as q
    from experiments.gpt.model import GPT  # imports jax: the parent process imports this module without
    from qsdp_jax import comm

    gpt = GPT(gpt_config(model))
    params = gpt.init_params(seed)
    built: dict[str, BuiltStep] = {}
    for name in configs:
        cfg = qsdp_config(name, seed=seed)
        opt = _optimizer(cfg)
        t0 = time.perf_counter()
        state = q.init_train_state(params, opt, mesh, cfg, stacked=gpt.stacked_groups)
        t1 = time.perf_counter()
        step_fn = q.make_train_step(gpt.loss, opt, mesh, cfg)
        compiled = cast("Wrapped", step_fn).lower(state, batch).compile(dict(compiler_options or {}) or None)
        t2 = time.perf_counter()
        report = comm.comm_report(compiled)
        built[name] = BuiltStep(
            name=name,
            compiled=compiled,
            state=state,
            bytes_per_device=float(report.total_bytes),
            bytes_by_kind_dtype={f"{k}/{d}": v for (k, d), v in report.by_kind_dtype().items()},
            compile_s=t2 - t1,
            init_s=t1 - t0,
        )
    return built


def network_benchmark(
    model: Mapping[str, int] | None = None,
    batch_per_process: int = 4,
    configs: Sequence[str] = CONFIG_NAMES,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    compiler_options: Mapping[str, Any] | None = None,
) -> dict:
    """Worker entry point: build every config's step, time them alternately, report.

    Returns (per process) ``{"process_index", "process_count", "device_count",
    "local_device_count", "model", "n_params", "batch_per_process", "global_batch",
    "configs": {name: {timing summary (seconds, ``TimingResult.to_dict``),
    "bytes_per_device", "bytes_per_process", "bytes_by_kind_dtype", "compile_s", "init_s",
    "final_loss"}}}``.  ``bytes_per_process`` = per-device bytes times the local device count
    (with one device per process: what the process puts on the network).
    """
    import jax
    import numpy as np

    import qsdp_jax as q
    from experiments.gpt.model import GPT  # imports jax: the parent process imports this module without

    model = dict(DEFAULT_MODEL if model is None else model)
    configs = list(configs)
    if len(set(configs)) != len(configs) or not configs:
        raise ValueError(f"configs must be non-empty and distinct, got {configs}")
    gcfg = gpt_config(model)
    mesh = q.make_mesh(AXIS)
    batch = make_batch(mesh, batch_per_process, gcfg.seq_len, gcfg.vocab_size, seed)
    t0 = time.perf_counter()
    built = build_steps(model, mesh, batch, configs, seed, compiler_options)
    build_s = time.perf_counter() - t0

    fns = {name: (lambda b=b: b.step(batch)) for name, b in built.items()}
    timings = time_alternating(fns, repeats=repeats, warmup=warmup, sync=jax.block_until_ready)

    n_local = jax.local_device_count()
    out_configs = {}
    for name, b in built.items():
        _, metrics = b.step(batch)  # one more (untimed) step, for the loss
        r = timings[name].to_dict()
        r.update(
            config=name,
            bytes_per_device=b.bytes_per_device,
            bytes_per_process=b.bytes_per_device * n_local,
            bytes_by_kind_dtype=b.bytes_by_kind_dtype,
            compile_s=b.compile_s,
            init_s=b.init_s,
            final_loss=float(np.asarray(metrics["loss"].addressable_data(0))),
        )
        out_configs[name] = r
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": n_local,
        "model": model,
        "n_params": GPT(gcfg).count_params(),
        "batch_per_process": batch_per_process,
        "global_batch": batch_per_process * jax.process_count(),
        "repeats": repeats,
        "warmup": warmup,
        "build_s": build_s,
        "compiler_options": dict(compiler_options or {}),
        "configs": out_configs,
    }
