"""QSDPConfig: what is quantized, how, and with which randomness.

Frozen and validated at construction: every invalid field raises ``ValueError`` naming the
field, the value it got and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

WeightMode = Literal["qsdp", "comm", "full"]
Rounding = Literal["stochastic", "nearest"]

WEIGHT_MODES = ("qsdp", "comm", "full")
WEIGHT_ROUNDINGS = ("shift", "stochastic")
GRAD_ROUNDINGS = ("stochastic", "nearest")
FP_COMM_DTYPES = ("float32", "bfloat16")
KERNEL_MODES = ("auto", "pallas", "reference", "interpret")


@dataclasses.dataclass(frozen=True)
class QSDPConfig:
    """Configuration of the quantized collectives and the weight grid.

    Attributes:
      weight_bits: bits per weight code on the all-gather (1..8), or None for full precision.
      grad_bits: bits per gradient code on the reduce-scatter (1..8), or None for full precision.
      bucket_size: elements that share one (scale, offset) pair; a multiple of 8 so that
        every bucket packs into whole bytes at any bit width.
      weight_mode:
        ``"qsdp"``: the weights themselves are kept on a randomly shifted quantization grid
        (the paper's method); the all-gather sends grid codes and is lossless.
        ``"comm"``: full-precision master weights, quantized (round to nearest) only for the
        all-gather, as in ZeRO++; the baseline QSDP has to beat.
        ``"full"``: weights gathered in ``fp_comm_dtype``; requires ``weight_bits=None``.
      weight_rounding: how ``"qsdp"`` mode projects updated weights onto a fresh grid:
        ``"stochastic"`` (the default): unbiased stochastic rounding on the bucket's min/max
        grid; ``"shift"`` (the paper's method): round to nearest on a grid shifted by a random
        fraction of a step per bucket. Both keep the weights on a grid (lossless all-gather) and
        are unbiased, but the shift's noise does not shrink with the update while stochastic
        rounding's does: at 4 bits the shift ruins training (README, "Choosing bits", has the
        measured cost), at 8 bits the two are alike.
      grad_rounding: ``"stochastic"`` (unbiased, the default) or ``"nearest"`` (biased).
      min_shard_size: leaves with fewer elements (per layer, for layer-stacked groups) stay
        full precision and replicated on every device: biases, norm scales.
      seed: root of all quantization randomness (see ``qsdp_jax.quantizers.derive_key``).
      fp_comm_dtype: dtype of the collectives that are not quantized (``"float32"`` or
        ``"bfloat16"``); the bf16 FSDP baseline is ``weight_bits=grad_bits=None`` with
        ``fp_comm_dtype="bfloat16"``.
      axis_name: the mesh axis the parameters are sharded over (on a two-level mesh: the inner,
        fast, intra-node level).
      node_axis: hierarchical FSDP on a ``(node_axis, axis_name)`` mesh (e.g. ``("node",
        "local")``): the weights are sharded over both axes, node-major, and every collective
        runs in two stages, one per level (see ``qsdp_jax.hierarchy``). None: a 1-D mesh.
      replica_axis: hybrid sharding on a ``(replica_axis, axis_name)`` mesh (e.g. ``("replica",
        "fsdp")``): sharded inside a group along ``axis_name``, replicated across groups; the
        cross-group gradient reduction is quantized too. At most one of ``node_axis`` and
        ``replica_axis``.
      inter_weight_bits, inter_grad_bits: bits on the outer (inter-node / cross-group) level;
        None (the default): the same as ``weight_bits`` / ``grad_bits``. ``weight_bits`` and
        ``grad_bits`` then are the inner (intra-node) level's. Only with ``node_axis`` or
        ``replica_axis``. In ``"qsdp"`` weight mode the weights live on one grid and both
        levels forward its codes (lossless), so ``inter_weight_bits`` must equal
        ``weight_bits``; it may differ in ``"comm"`` and ``"full"`` modes (e.g. fp32 inside a
        node, 8-bit round-to-nearest across). ``inter_grad_bits`` with ``grad_bits=None``
        means ``fp_comm_dtype`` inside a node and quantized across (e.g. bf16 in, 4-bit out).
      kernels: who runs the quantize / pack hot path (see ``qsdp_jax.kernels.dispatch``):
        ``"auto"`` (Pallas kernels on GPU and TPU, the jnp reference on CPU), ``"pallas"``
        (chosen per lowering platform, for exporting to GPU/TPU from a CPU host),
        ``"reference"`` (the jnp reference everywhere) or ``"interpret"`` (the kernels in
        Pallas interpret mode on any backend; slow, for tests on CPU).
    """

    weight_bits: int | None = 8
    grad_bits: int | None = 8
    bucket_size: int = 1024
    weight_mode: WeightMode = "qsdp"
    weight_rounding: str = "stochastic"
    grad_rounding: Rounding = "stochastic"
    min_shard_size: int = 4096
    seed: int = 0
    fp_comm_dtype: str = "float32"
    axis_name: str = "fsdp"
    node_axis: str | None = None
    replica_axis: str | None = None
    inter_weight_bits: int | None = None
    inter_grad_bits: int | None = None
    kernels: str = "auto"

    def __post_init__(self):
        _check_bits("weight_bits", self.weight_bits)
        _check_bits("grad_bits", self.grad_bits)
        _check_int("bucket_size", self.bucket_size, minimum=8)
        if self.bucket_size % 8:
            _fail("bucket_size", self.bucket_size, "a multiple of 8 (8 codes pack into whole bytes)")
        _check_choice("weight_mode", self.weight_mode, WEIGHT_MODES)
        _check_choice("weight_rounding", self.weight_rounding, WEIGHT_ROUNDINGS)
        _check_choice("grad_rounding", self.grad_rounding, GRAD_ROUNDINGS)
        _check_int("min_shard_size", self.min_shard_size, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        if self.seed >= 2**32:
            _fail("seed", self.seed, "an integer in [0, 2**32)")
        _check_choice("fp_comm_dtype", self.fp_comm_dtype, FP_COMM_DTYPES)
        _check_choice("kernels", self.kernels, KERNEL_MODES)
        if not isinstance(self.axis_name, str) or not self.axis_name:
            _fail("axis_name", self.axis_name, "a non-empty mesh axis name")
        if self.weight_mode == "full" and self.weight_bits is not None:
            _fail(
                "weight_bits",
                self.weight_bits,
                "None when weight_mode='full' (use weight_mode='qsdp' or 'comm' to quantize weights)",
            )
        if self.weight_mode in ("qsdp", "comm") and self.weight_bits is None:
            _fail(
                "weight_bits",
                None,
                f"an integer 1..8 when weight_mode={self.weight_mode!r} (use weight_mode='full' "
                "for full-precision weights)",
            )
        if self.weight_mode == "qsdp" and self.weight_rounding == "shift" and self.weight_bits == 1:
            _fail(
                "weight_bits",
                1,
                "2..8 with weight_mode='qsdp' and weight_rounding='shift': a randomly shifted "
                "grid needs one spare level to cover the bucket range for every shift, and 2 "
                "levels leave none (weight_rounding='stochastic' or weight_mode='comm' accept 1)",
            )
        self._check_levels()

    def _check_levels(self):
        """Validate the two-level fields (mesh axes and per-level bits)."""
        for field in ("node_axis", "replica_axis"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v):
                _fail(field, v, "None or a non-empty mesh axis name")
            if v is not None and v == self.axis_name:
                _fail(field, v, f"an axis other than axis_name={self.axis_name!r}")
        if self.node_axis is not None and self.replica_axis is not None:
            _fail(
                "replica_axis", self.replica_axis,
                f"None when node_axis={self.node_axis!r} is set (two levels at most: a mesh is "
                "either hierarchical (node_axis) or hybrid (replica_axis))",
            )
        _check_bits("inter_weight_bits", self.inter_weight_bits)
        _check_bits("inter_grad_bits", self.inter_grad_bits)
        for field in ("inter_weight_bits", "inter_grad_bits"):
            v = getattr(self, field)
            if v is not None and self.outer_axis is None:
                _fail(
                    field, v,
                    "None on a 1-D mesh: per-level bits need two levels (set node_axis for a "
                    "hierarchical ('node', 'local') mesh or replica_axis for a hybrid one)",
                )
        if self.inter_weight_bits is not None and self.weight_mode == "qsdp":
            if self.inter_weight_bits != self.weight_bits:
                _fail(
                    "inter_weight_bits", self.inter_weight_bits,
                    f"None or equal to weight_bits={self.weight_bits} with weight_mode='qsdp': "
                    "the weights live on one grid and every level forwards its codes, which keeps "
                    "the gather lossless (per-level weight bits need weight_mode 'comm' or 'full')",
                )
        if self.replica_axis is not None and self.inter_weight_bits is not None:
            _fail(
                "inter_weight_bits", self.inter_weight_bits,
                "None with replica_axis: a hybrid mesh gathers weights only inside a group",
            )

    # --- convenience constructors -------------------------------------------------------------
    @classmethod
    def fp32(cls, **kw) -> "QSDPConfig":
        """Plain FSDP with fp32 collectives: the baseline everything is compared against."""
        return cls(weight_bits=None, grad_bits=None, weight_mode="full", fp_comm_dtype="float32", **kw)

    @classmethod
    def bf16(cls, **kw) -> "QSDPConfig":
        """FSDP with bf16 collectives (weights cast for the gather, gradients for the scatter)."""
        return cls(weight_bits=None, grad_bits=None, weight_mode="full", fp_comm_dtype="bfloat16", **kw)

    @classmethod
    def qsdp(cls, weight_bits: int = 8, grad_bits: int | None = 8, **kw) -> "QSDPConfig":
        """QSDP: weights kept on a quantization grid (stochastic rounding by default), quantized
        gradients."""
        return cls(weight_bits=weight_bits, grad_bits=grad_bits, weight_mode="qsdp", **kw)

    @classmethod
    def from_name(cls, name: str, **kw) -> "QSDPConfig":
        """The config a :attr:`name` stands for: ``fp32``, ``bf16``, ``qsdp-W8G8``,
        ``qsdp-sr-W4G4``, ``comm-W4GF32``, ``full-WF32G8``, or bare ``W8G8`` (QSDP). A name
        states the weight rounding: ``qsdp-`` and bare names are the paper's shift, ``qsdp-sr-``
        stochastic rounding (the default of ``QSDPConfig``), so ``from_name(c.name) == c``."""
        if name == "fp32":
            return cls.fp32(**kw)
        if name == "bf16":
            return cls.bf16(**kw)
        m = _NAME.fullmatch(name)
        if m is None:
            raise ValueError(
                f"unknown config name {name!r}: use fp32, bf16 or <mode>-W<bits>G<bits> with mode "
                "qsdp, qsdp-sr, comm or full and bits 1..8, F32 or BF16 (e.g. qsdp-W8G8, comm-W4G4)"
            )
        mode, w, g = m.group(1) or "qsdp", m.group(2), m.group(3)
        fp = {x for x in (w, g) if not x.isdigit()}
        if len(fp) > 1:
            raise ValueError(f"config name {name!r} mixes F32 and BF16")
        fields = dict(
            weight_mode="qsdp" if mode == "qsdp-sr" else mode,
            weight_bits=int(w) if w.isdigit() else None,
            grad_bits=int(g) if g.isdigit() else None,
            fp_comm_dtype="bfloat16" if fp == {"BF16"} else "float32",
        )
        if mode in ("qsdp", "qsdp-sr"):  # the name says the rounding: qsdp- is the paper's shift
            fields["weight_rounding"] = "stochastic" if mode == "qsdp-sr" else "shift"
        return cls(**{**fields, **kw})

    @property
    def quantizes_weights(self) -> bool:
        return self.weight_bits is not None

    @property
    def quantizes_grads(self) -> bool:
        return self.grad_bits is not None

    @property
    def outer_axis(self) -> str | None:
        """The outer (inter-node / cross-group) mesh axis, or None on a 1-D mesh."""
        return self.node_axis if self.node_axis is not None else self.replica_axis

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes this config runs on, outer first: ``(axis_name,)``,
        ``(node_axis, axis_name)`` or ``(replica_axis, axis_name)``."""
        outer = self.outer_axis
        return (self.axis_name,) if outer is None else (outer, self.axis_name)

    @property
    def shard_axes(self) -> str | tuple[str, str]:
        """What the weights are sharded over, as JAX collectives and PartitionSpecs take it:
        ``axis_name`` (1-D and hybrid) or ``(node_axis, axis_name)`` (hierarchical, node-major)."""
        return self.axis_name if self.node_axis is None else (self.node_axis, self.axis_name)

    @property
    def batch_axes(self) -> str | tuple[str, str]:
        """What the batch is split over: every axis of the mesh."""
        return self.axis_name if self.outer_axis is None else self.mesh_axes

    @property
    def outer_weight_bits(self) -> int | None:
        """Weight bits on the outer level (``inter_weight_bits``, else ``weight_bits``)."""
        return self.weight_bits if self.inter_weight_bits is None else self.inter_weight_bits

    @property
    def outer_grad_bits(self) -> int | None:
        """Gradient bits on the outer level (``inter_grad_bits``, else ``grad_bits``)."""
        return self.grad_bits if self.inter_grad_bits is None else self.inter_grad_bits

    @property
    def name(self) -> str:
        """A short label for tables: ``fp32``, ``bf16``, ``qsdp-W8G8``, ``comm-W4G4``..."""
        if self.weight_bits is None and self.grad_bits is None:
            return ("fp32" if self.fp_comm_dtype == "float32" else "bf16") + self._level_suffix()
        fp = "F32" if self.fp_comm_dtype == "float32" else "BF16"
        w = f"W{self.weight_bits}" if self.weight_bits is not None else f"W{fp}"
        g = f"G{self.grad_bits}" if self.grad_bits is not None else f"G{fp}"
        mode = self.weight_mode
        if mode == "qsdp" and self.weight_rounding == "stochastic":
            mode = "qsdp-sr"
        return f"{mode}-{w}{g}{self._level_suffix()}"

    def _level_suffix(self) -> str:
        """``-xW4`` / ``-xG4`` when the outer level's bits differ (``x``: across nodes)."""
        fmt = lambda b: "F32" if b is None else str(b)  # noqa: E731
        out = ""
        if self.outer_weight_bits != self.weight_bits:
            out += f"-xW{fmt(self.outer_weight_bits)}"
        if self.outer_grad_bits != self.grad_bits:
            out += f"-xG{fmt(self.outer_grad_bits)}"
        return out


_NAME = re.compile(r"(?:(qsdp-sr|qsdp|comm|full)-)?W([1-8]|F32|BF16)G([1-8]|F32|BF16)")


def _fail(field: str, value, allowed: str):
    raise ValueError(f"QSDPConfig.{field}={value!r} is invalid: must be {allowed}")


def _check_int(field: str, value, *, minimum: int):
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(field, value, f"an integer >= {minimum}")
    if value < minimum:
        _fail(field, value, f"an integer >= {minimum}")


def _check_bits(field: str, value):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
        _fail(field, value, "None (full precision) or an integer in 1..8")


def _check_choice(field: str, value, choices):
    if value not in choices:
        _fail(field, value, f"one of {', '.join(repr(c) for c in choices)}")
