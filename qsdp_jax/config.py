"""QSDPConfig: what is quantized, how, and with which randomness.

Frozen and validated at construction: every invalid field raises ``ValueError`` naming the
field, the value it got and what is allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from qsdp_jax._src.config import checks as _checks
from qsdp_jax._src.config import names as _names
from qsdp_jax._src.config.checks import STATS_DTYPES  # noqa: F401  (qsdp_jax.config.STATS_DTYPES)
from qsdp_jax._src.config.checks import check_bits as _check_bits
from qsdp_jax._src.config.checks import check_choice as _check_choice
from qsdp_jax._src.config.checks import check_int as _check_int
from qsdp_jax._src.config.checks import fail as _fail

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

    Frozen (hashable) and validated at construction. The classmethods :meth:`fp32`, :meth:`bf16`,
    :meth:`qsdp` and :meth:`from_name` build the usual configs; :attr:`name` labels one.

    Attributes:
      weight_bits: bits per weight code on the all-gather (1..8), or None for full precision.
        Default 8. Must be None when ``weight_mode="full"`` and an integer in ``"qsdp"`` and
        ``"comm"`` modes; 2..8 with ``weight_mode="qsdp"`` and ``weight_rounding="shift"``.
      grad_bits: bits per gradient code on the reduce-scatter (1..8), or None for full
        precision (``fp_comm_dtype``). Default 8.
      bucket_size: elements that share one (scale, offset) pair; a multiple of 8 (at least 8) so
        that every bucket packs into whole bytes at any bit width. Default 1024.
      weight_mode: ``"qsdp"`` (the default): the weights themselves are kept on a quantization
        grid (the paper's method; how the grid is drawn: ``weight_rounding``); the all-gather
        sends grid codes and is lossless. ``"comm"``: full-precision master weights, quantized
        (round to nearest) only for the all-gather, as in ZeRO++; the baseline QSDP has to
        beat. ``"full"``: weights gathered in ``fp_comm_dtype``; requires ``weight_bits=None``.
      weight_rounding: how ``"qsdp"`` mode projects updated weights onto a fresh grid:
        ``"stochastic"`` (the default): unbiased stochastic rounding on the bucket's min/max
        grid; ``"shift"`` (the paper's method): round to nearest on a grid shifted by a random
        fraction of a step per bucket. Both keep the weights on a grid (lossless all-gather) and
        are unbiased, but the shift's noise does not shrink with the update while stochastic
        rounding's does: at 4 bits the shift ruins training (docs/guides/configuration.md, "Choosing bits", has the
        measured cost), at 8 bits the two are alike.
      grad_rounding: ``"stochastic"`` (unbiased, the default) or ``"nearest"`` (biased).
      min_shard_size: leaves with fewer elements (per layer, for layer-stacked groups) stay
        full precision and replicated on every device: biases, norm scales. An integer >= 0;
        default 4096.
      seed: root of all quantization randomness (see ``qsdp_jax._src.quant.quantizers.derive_key``);
        an integer in ``[0, 2**32)``, default 0.
      fp_comm_dtype: dtype of the collectives that are not quantized (``"float32"``, the
        default, or ``"bfloat16"``); the bf16 FSDP baseline is ``weight_bits=grad_bits=None``
        with ``fp_comm_dtype="bfloat16"``.
      axis_name: the mesh axis the parameters are sharded over (on a two-level mesh: the inner,
        fast, intra-node level); a non-empty string, default ``"fsdp"``.
      node_axis: hierarchical FSDP on a ``(node_axis, axis_name)`` mesh (e.g. ``("node",
        "local")``): the weights are sharded over both axes, node-major, and every collective
        runs in two stages, one per level (see ``qsdp_jax._src.collective.hierarchy``). None (the
        default): a 1-D mesh. Must differ from ``axis_name``.
      replica_axis: hybrid sharding on a ``(replica_axis, axis_name)`` mesh (e.g. ``("replica",
        "fsdp")``): sharded inside a group along ``axis_name``, replicated across groups; the
        cross-group gradient reduction is quantized too. Default None; must differ from
        ``axis_name``. At most one of ``node_axis`` and ``replica_axis``.
      inter_weight_bits: weight bits on the outer (inter-node) level; None (the default): the
        same as ``weight_bits``, which then is the inner (intra-node) level's. Only with
        ``node_axis``: it must be None with ``replica_axis`` (a hybrid mesh gathers weights only
        inside a group) and on a 1-D mesh. In ``"qsdp"`` weight mode the weights live on one
        grid and both levels forward its codes (lossless), so it must equal ``weight_bits``;
        it may differ in ``"comm"`` and ``"full"`` modes (e.g. fp32 inside a node, 8-bit
        round-to-nearest across).
      inter_grad_bits: gradient bits on the outer (inter-node / cross-group) level; None (the
        default): the same as ``grad_bits``, which then is the inner level's. Only with
        ``node_axis`` or ``replica_axis``. With ``grad_bits=None`` it means ``fp_comm_dtype``
        inside a node and quantized across (e.g. bf16 in, 4-bit out).
      kernels: who runs the quantize / pack hot path (see ``qsdp_jax.kernels.dispatch``):
        ``"auto"`` (the default: Pallas kernels on TPU, the jnp reference on CPU and GPU, where
        XLA's fusion of it was within 10% of the Triton kernels or faster on an H200),
        ``"pallas"`` (chosen per lowering platform, for exporting to GPU/TPU from a CPU host),
        ``"reference"`` (the jnp reference everywhere) or ``"interpret"`` (the kernels in
        Pallas interpret mode on any backend; slow, for tests on CPU).
      grad_rotation: None (the default), or a Hadamard block size: rotate gradient chunks
        blockwise before quantizing them for the reduce-scatter (``qsdp_jax._src.quant.rotation``).
        A power of 2 >= 2 dividing ``bucket_size``; needs quantized gradients (``grad_bits``
        not None) and a 1-D mesh.
      stats_dtype: ``"float32"`` (the default), or ``"bfloat16"``: per-bucket scale and offset
        on the wire as bf16 (4 bytes per bucket instead of 8). ``"comm"`` / ``"full"`` modes
        and 1-D meshes only: weights kept on a bf16 grid (``"qsdp"`` mode) ratchet its range
        outward (``experiments/grid_walk.py``).
      weight_storage: how the train state holds the gridded weights: ``"float32"`` (the
        default) or ``"codes"``, each device's block as its packed b-bit codes (the grid's
        scales and offsets are in the optimizer state already), a quarter of the bytes at 8
        bits; lossless, since the weights are on their grid (``qsdp_jax._src.quant.weight_codes``).
        ``"codes"`` needs ``weight_mode="qsdp"``.
      bit_policy: per-leaf bits by parameter path, ordered rules ``(pattern, weight_bits,
        grad_bits)``, e.g. ``(("embed/*", 8, 8), ("head/out/*", 8, None))`` (a list is
        accepted and stored as a tuple). A sharded leaf takes the bits of the first rule whose
        pattern matches its path, unmatched leaves use ``weight_bits`` / ``grad_bits`` (see
        ``qsdp_jax._src.layout.policy`` for the path and pattern language: ``fnmatch`` on
        ``"group/key/key"``). Leaves with other bits go into buffers of their own (one per
        distinct bits in a group), each with its own collectives and grid. Each rule's pattern
        is a non-empty string used by no earlier rule, its bits None or 1..8. Rule bits follow
        the global rules of the weight mode: in ``"full"`` mode the weight bits must be None; in
        ``"qsdp"`` mode None means full-precision weights for those leaves (no grid, gathered in
        float32, so only with ``fp_comm_dtype="float32"``: the gather stays lossless) and 1 is
        refused with the shift rounding; grad bits None reduce-scatter in ``fp_comm_dtype``. On
        a two-level mesh a rule's bits apply on both levels. A rule that matches no sharded
        leaf is refused when the layout is built (``ValueError``). ``()`` (the default): no
        policy, the layout and step of a policy-less config.

    Raises:
      ValueError: any invalid field or combination of fields; the message names the field, the
        value it got and what is allowed.
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
    grad_rotation: int | None = None
    stats_dtype: str = "float32"
    weight_storage: str = "float32"
    bit_policy: tuple[tuple[str, int | None, int | None], ...] = ()

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
        _checks.check_storage(self)
        _checks.check_levels(self)
        _checks.check_levers(self)
        _checks.check_policy(self)

    def buffer_config(self, weight_bits: int | None, grad_bits: int | None) -> "QSDPConfig":
        """The config of one buffer of a :attr:`bit_policy`: these bits on every level, no policy.

        Args:
          weight_bits: the buffer's weight bits (1..8), or None: a full-precision buffer
            (``weight_mode="full"``, whatever this config's mode).
          grad_bits: the buffer's gradient bits (1..8), or None: reduce-scattered in
            ``fp_comm_dtype`` (and not rotated: ``grad_rotation`` is dropped).

        Returns:
          A copy of this config with those bits, ``inter_weight_bits`` / ``inter_grad_bits``
          None and an empty ``bit_policy`` (and float32 ``weight_storage`` for a
          full-precision buffer).

        Raises:
          ValueError: the bits are invalid for this config (validated as any new config is).
        """
        mode = "full" if weight_bits is None else self.weight_mode
        return dataclasses.replace(
            self,
            weight_bits=weight_bits,
            grad_bits=grad_bits,
            weight_mode=mode,
            weight_storage=self.weight_storage if mode == "qsdp" else "float32",
            inter_weight_bits=None,
            inter_grad_bits=None,
            bit_policy=(),
            grad_rotation=None if grad_bits is None else self.grad_rotation,  # fp gradients: no rotation
        )

    # --- convenience constructors -------------------------------------------------------------
    @classmethod
    def fp32(cls, **kw) -> "QSDPConfig":
        """Plain FSDP with fp32 collectives: the baseline everything is compared against.

        Args:
          **kw: other fields of the config (not ``weight_bits``, ``grad_bits``, ``weight_mode``
            or ``fp_comm_dtype``, which this constructor sets: repeating one is a ``TypeError``).

        Returns:
          ``QSDPConfig(weight_bits=None, grad_bits=None, weight_mode="full",
          fp_comm_dtype="float32", **kw)``.

        Raises:
          ValueError: an invalid field in ``kw``.
        """
        return cls(weight_bits=None, grad_bits=None, weight_mode="full", fp_comm_dtype="float32", **kw)

    @classmethod
    def bf16(cls, **kw) -> "QSDPConfig":
        """FSDP with bf16 collectives (weights cast for the gather, gradients for the scatter).

        Args:
          **kw: other fields of the config (not ``weight_bits``, ``grad_bits``, ``weight_mode``
            or ``fp_comm_dtype``, which this constructor sets: repeating one is a ``TypeError``).

        Returns:
          ``QSDPConfig(weight_bits=None, grad_bits=None, weight_mode="full",
          fp_comm_dtype="bfloat16", **kw)``.

        Raises:
          ValueError: an invalid field in ``kw``.
        """
        return cls(weight_bits=None, grad_bits=None, weight_mode="full", fp_comm_dtype="bfloat16", **kw)

    @classmethod
    def qsdp(cls, weight_bits: int = 8, grad_bits: int | None = 8, **kw) -> "QSDPConfig":
        """QSDP: weights kept on a quantization grid (stochastic rounding by default), quantized
        gradients.

        Args:
          weight_bits: bits of the weight grid, 1..8 (2..8 with ``weight_rounding="shift"``);
            default 8.
          grad_bits: bits of the gradient reduce-scatter, 1..8, or None for ``fp_comm_dtype``;
            default 8.
          **kw: other fields of the config, e.g. ``weight_rounding="shift"`` for the paper's
            rounding (not ``weight_mode``, which this constructor sets to ``"qsdp"``).

        Returns:
          ``QSDPConfig(weight_bits=weight_bits, grad_bits=grad_bits, weight_mode="qsdp", **kw)``.

        Raises:
          ValueError: an invalid field.
        """
        return cls(weight_bits=weight_bits, grad_bits=grad_bits, weight_mode="qsdp", **kw)

    @classmethod
    def from_name(cls, name: str, **kw) -> "QSDPConfig":
        """The config a :attr:`name` stands for.

        A name states the weight rounding: ``qsdp-`` and bare names are the paper's shift,
        ``qsdp-sr-`` stochastic rounding (the default of ``QSDPConfig``), so
        ``from_name(c.name) == c`` for a config whose other fields are the defaults (a name
        does not record, e.g., ``seed``, ``bucket_size`` or the ``fp_comm_dtype`` of a config
        quantizing both weights and gradients). ``F32`` / ``BF16`` bits set ``fp_comm_dtype``.

        Args:
          name: ``fp32``, ``bf16``, or ``<mode>-W<bits>G<bits>`` with mode ``qsdp``,
            ``qsdp-sr``, ``comm`` or ``full`` (or no ``<mode>-``: ``qsdp``) and bits 1..8,
            ``F32`` or ``BF16``, e.g. ``qsdp-W8G8``, ``qsdp-sr-W4G4``, ``comm-W4GF32``,
            ``full-WF32G8``, ``W8G8``. The suffixes :attr:`name` adds (``-xW4``, ``-rot64``,
            ``-bf16stats``, ``-pW8G8``) are not parsed.
          **kw: further fields; they override those the name sets (for ``fp32`` / ``bf16``
            they may not repeat the fields :meth:`fp32` / :meth:`bf16` set: ``TypeError``).

        Returns:
          The config.

        Raises:
          ValueError: an unknown name, a name mixing ``F32`` and ``BF16``, or an invalid
            resulting config (e.g. ``qsdp-WF32G8``: ``"qsdp"`` mode needs weight bits).
        """
        if name == "fp32":
            return cls.fp32(**kw)
        if name == "bf16":
            return cls.bf16(**kw)
        return cls(**{**_names.fields_from_name(name), **kw})

    @property
    def quantizes_weights(self) -> bool:
        """True when the weight all-gather is quantized (``weight_bits`` is not None)."""
        return self.weight_bits is not None

    @property
    def quantizes_grads(self) -> bool:
        """True when the gradient reduce-scatter is quantized (``grad_bits`` is not None)."""
        return self.grad_bits is not None

    @property
    def outer_axis(self) -> str | None:
        """The outer (inter-node / cross-group) mesh axis, or None on a 1-D mesh."""
        return self.node_axis if self.node_axis is not None else self.replica_axis

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes this config runs on, outer first (``(axis_name,)``,
        ``(node_axis, axis_name)`` or ``(replica_axis, axis_name)``)."""
        outer = self.outer_axis
        return (self.axis_name,) if outer is None else (outer, self.axis_name)

    @property
    def shard_axes(self) -> str | tuple[str, str]:
        """What the weights are sharded over, as JAX collectives and PartitionSpecs take it
        (``axis_name`` on 1-D and hybrid meshes, ``(node_axis, axis_name)`` on hierarchical
        ones, node-major)."""
        return self.axis_name if self.node_axis is None else (self.node_axis, self.axis_name)

    @property
    def batch_axes(self) -> str | tuple[str, str]:
        """What the batch is split over (every axis of the mesh), as collectives take it."""
        outer = self.outer_axis
        return self.axis_name if outer is None else (outer, self.axis_name)

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
        """A short label for tables, e.g. ``fp32``, ``bf16``, ``qsdp-W8G8``, ``comm-W4G4``.

        Suffixes name the outer level's bits (``-xW4``, ``-xG4``), the gradient rotation
        (``-rot64``), compact statistics (``-bf16stats``), code-held weights (``-codes``) and
        each distinct bits of a bit policy (``-pW8G8``); :meth:`from_name` reads the names
        without suffixes."""
        return _names.config_name(self)


def check_config(config) -> None:
    """``TypeError`` unless ``config`` is a :class:`QSDPConfig` (what every entry point taking a
    config checks first)."""
    if not isinstance(config, QSDPConfig):
        raise TypeError(f"config must be a QSDPConfig, got {type(config).__name__}")
