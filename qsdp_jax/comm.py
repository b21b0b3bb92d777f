"""Communication volume of a compiled program: wire bytes per device per step.

:func:`comm_report` compiles a jitted function (or takes an already ``Compiled`` one), reads the
optimized HLO text (``compiled.as_text()``) and lists every collective with the number of bytes
one device puts on the wire for it in one call of the program. :func:`comm_report_from_hlo` does
the same from HLO text. The result is a :class:`CommReport` that sums by collective kind and
element type (``total_bytes``, ``by_kind()``, ``by_dtype()``, ``by_kind_dtype()``), serialises
(``as_dict()``) and prints (``table()``).

Wire-byte model
---------------
Per device, bandwidth-optimal ring algorithms, for a replica group of ``N`` devices and the
payload ``B`` (bytes of the buffer named below, summed over all operands of a variadic op):

=====================  ===============================  ===============================
collective             B                                bytes on the wire per device
=====================  ===============================  ===============================
all-gather             result (the gathered buffer)     ``B * (N-1)/N``
reduce-scatter         operand (the full input)         ``B * (N-1)/N`` (= result*(N-1))
all-reduce             operand (= result)               ``2 * B * (N-1)/N``
all-to-all             operand (all of them)            ``B * (N-1)/N``
collective-permute     operand (= result)               ``B`` (0 if no pair moves data)
=====================  ===============================  ===============================

``N == 1`` costs zero. The per-call figure is multiplied by how many times the op runs per step
(``Collective.count``): the product of the trip counts of the ``while`` loops around it (a
``lax.scan`` compiles to a ``while``; nested loops multiply).

How the HLO is read: see :mod:`qsdp_jax._src.hlo.reader` (loops multiply by their known trip count,
every branch of a conditional counts, async collectives count once at their start); the model
above is applied to each collective in :mod:`qsdp_jax._src.hlo.wire_model`. A program compiled for
several TPU slices sends what crosses the slices to the megascale runtime (``send`` / ``recv``
host transfers): each is read as the collective it implements, over the slices, counted at its
``send`` (``opcode == "send"``, no replica groups; :mod:`qsdp_jax._src.hlo.megascale`).

Bytes per mesh axis
-------------------
Each collective keeps its replica groups (positions in the compiled program's device
assignment, i.e. in ``mesh.devices.flat``). :meth:`CommReport.by_axis` names the mesh axes each
group spans (``"local"``, ``"node"``, ``"node+local"``) and sums the bytes by those names;
:meth:`CommReport.bytes_spanning` sums the bytes of the collectives whose groups cross an axis
(on a ``("node", "local")`` mesh, ``bytes_spanning(mesh, "node")`` is the inter-node traffic).

Limitations
-----------
* The model ignores latency, algorithm choice (tree / 2-D / NVLS), and the
  cross-replica-and-partition mode where a group of replicas spans several partitions.
* ``ragged-all-to-all``, ``collective-broadcast`` and device-to-device ``send`` / ``recv`` are
  not modelled; they are reported in ``warnings``. Host transfers other than the megascale ones
  are skipped.
* On CPU, XLA upcasts bf16/f16 collectives to f32 (the HLO shows ``f32`` all-gathers of
  converted bf16 data); the report shows what the compiled program moves.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any, Callable

from qsdp_jax._src.hlo.reader import (  # noqa: F401  (DTYPE_BITS, KINDS: part of this module's API)
    DTYPE_BITS,
    KINDS,
    HloModule,
    UnknownTripCountError,
    parse_module,
    parse_replica_groups,
)
from qsdp_jax._src.hlo import comm_table
from qsdp_jax._src.hlo.sites import collective_sites
from qsdp_jax._src.hlo.wire_model import site_collectives

__all__ = [
    "Collective",
    "CommReport",
    "UnknownTripCountError",
    "axes_spanned",
    "comm_report",
    "comm_report_from_hlo",
    "parse_replica_groups",
    "DTYPE_BITS",
]


# ----------------------------------------------------------------------------------------------
# Public result types


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction (one element type of it) and its wire bytes per step.

    Attributes:
      kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, ``"all-to-all"`` or
        ``"collective-permute"`` (async starts are reported under their synchronous kind).
      dtype: HLO element type of the payload, e.g. ``"f32"``, ``"u8"``.
      bytes_on_wire: bytes one device sends per step for this op (already times ``count``).
      group_size: devices in the replica group (for collective-permute: distinct devices in
        ``source_target_pairs``).
      count: how many times the op runs per step (product of enclosing loop trip counts).
      payload_bytes: bytes of the buffer the model scales (see the module docstring), one call.
      name: the HLO instruction name (no ``%``).
      computation: the HLO computation holding the instruction.
      opcode: the HLO opcode as printed (``all-gather-start``, ``all-to-all``, ...).
      trip_count_known: False if a loop around the op had no known trip count (counted once).
      replica_groups: the device groups (positions in the device assignment, i.e. in
        ``mesh.devices.flat``); for collective-permute the moving (source, target) pairs.
    """

    kind: str
    dtype: str
    bytes_on_wire: float
    group_size: int
    count: int
    payload_bytes: int
    name: str
    computation: str
    opcode: str
    trip_count_known: bool = True
    replica_groups: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), repr=False)


@dataclasses.dataclass(frozen=True)
class CommReport:
    """All collectives of one compiled program with their per-device, per-step wire bytes.

    Made by :func:`comm_report` / :func:`comm_report_from_hlo`.

    Attributes:
      collectives: one :class:`Collective` per instruction and element type.
      num_devices: the devices of the program (what an empty ``replica_groups={}`` means).
      warnings: what the reader could not model or had to guess (unmodelled ops such as
        ``send`` / ``recv``, loops of unknown trip count, operand shapes derived from results);
        also printed by :meth:`table`.
    """

    collectives: tuple[Collective, ...]
    num_devices: int
    warnings: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> float:
        """Bytes one device sends per step, all collectives together."""
        return float(sum(c.bytes_on_wire for c in self.collectives))

    def by_kind(self) -> dict[str, float]:
        """Wire bytes summed by collective kind.

        Returns:
          ``{kind: bytes}`` (e.g. ``{"all-gather": ..., "reduce-scatter": ...}``), kinds that occur.
        """
        return self._sum(lambda c: c.kind)

    def by_dtype(self) -> dict[str, float]:
        """Wire bytes summed by element type.

        Returns:
          ``{dtype: bytes}`` with HLO element types (``"f32"``, ``"u8"``...) that occur.
        """
        return self._sum(lambda c: c.dtype)

    def by_kind_dtype(self) -> dict[tuple[str, str], float]:
        """Wire bytes summed by ``(kind, dtype)``.

        Returns:
          ``{(kind, dtype): bytes}``.
        """
        return self._sum(lambda c: (c.kind, c.dtype))

    def by_axis(self, mesh: Any) -> dict[str, float]:
        """Wire bytes summed by the mesh axes each collective's groups span.

        Args:
          mesh: the program's mesh: a ``jax.sharding.Mesh`` (or anything with an ordered
            ``.shape`` mapping) or a mapping ``{axis name: size}``, outermost axis first; its
            sizes must multiply to :attr:`num_devices`.

        Returns:
          ``{axes: bytes}`` keyed ``"local"``, ``"node"``, ``"node+local"`` (axis names joined
          in mesh order), ``"none"`` when no data moves.

        Raises:
          TypeError: ``mesh`` is neither a mesh nor a mapping.
          ValueError: the mesh's size is not :attr:`num_devices`, or a group holds a device
            position outside it.
        """
        shape = _mesh_sizes(mesh, self.num_devices)
        return self._sum(lambda c: "+".join(axes_spanned(c.replica_groups, shape)) or "none")

    def bytes_spanning(self, mesh: Any, axis: str) -> float:
        """Bytes of the collectives whose groups cross ``axis`` (e.g. the inter-node bytes
        on a ``("node", "local")`` mesh with ``axis="node"``).

        Args:
          mesh: the program's mesh, as for :meth:`by_axis`.
          axis: the name of one of its axes.

        Returns:
          The wire bytes per device per step of the collectives spanning ``axis``.

        Raises:
          TypeError: ``mesh`` is neither a mesh nor a mapping.
          ValueError: ``axis`` is not an axis of ``mesh``, or as for :meth:`by_axis`.
        """
        shape = _mesh_sizes(mesh, self.num_devices)
        if axis not in shape:
            raise ValueError(f"axis {axis!r} is not a mesh axis; the mesh has {tuple(shape)}")
        return float(sum(c.bytes_on_wire for c in self.collectives if axis in axes_spanned(c.replica_groups, shape)))

    def _sum(self, key: Callable[[Collective], Any]) -> dict:
        out: dict = defaultdict(float)
        for c in self.collectives:
            out[key(c)] += c.bytes_on_wire
        return dict(out)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary.

        Returns:
          ``{"total_bytes", "num_devices", "by_kind", "by_dtype", "by_kind_dtype",
          "collectives", "warnings"}``: ``by_kind_dtype`` keyed ``"kind/dtype"``, each
          collective as a dict of its fields without ``replica_groups``.
        """
        return {
            "total_bytes": self.total_bytes,
            "num_devices": self.num_devices,
            "by_kind": self.by_kind(),
            "by_dtype": self.by_dtype(),
            "by_kind_dtype": {f"{k}/{d}": v for (k, d), v in self.by_kind_dtype().items()},
            "collectives": [
                {k: v for k, v in dataclasses.asdict(c).items() if k != "replica_groups"} for c in self.collectives
            ],
            "warnings": list(self.warnings),
        }

    def to_json(self, **kwargs: Any) -> str:
        """The report as JSON.

        Args:
          **kwargs: passed to ``json.dumps`` (e.g. ``indent=2``).

        Returns:
          ``json.dumps(self.as_dict(), **kwargs)``.
        """
        return json.dumps(self.as_dict(), **kwargs)

    def table(self, per_op: bool = False) -> str:
        """A text table of the report.

        Args:
          per_op: one row per instruction (computation/name, kind, dtype, group size, count
            (``?`` when a trip count was unknown), payload and wire bytes) instead of one per
            ``(kind, dtype)`` (ops, calls per step, wire bytes). Default False.

        Returns:
          The table, a total row, then one ``warning:`` line per entry of :attr:`warnings`.
        """
        return comm_table.format_table(self, per_op)


def axes_spanned(groups: Any, mesh: Any) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group in ``groups`` differ, in mesh order.

    ``groups``: device-position groups as in :attr:`Collective.replica_groups`; ``mesh``: as in
    :meth:`CommReport.by_axis`. A position ``p`` sits at ``numpy.unravel_index(p, sizes)``."""
    import numpy as np

    sizes = _mesh_sizes(mesh, None)
    names, dims = tuple(sizes), tuple(sizes.values())
    total = int(np.prod(dims))
    spanned: set[int] = set()
    for g in groups:
        if len(g) <= 1:
            continue
        ids = np.asarray(g)
        if ids.min() < 0 or ids.max() >= total:
            raise ValueError(f"device position {int(ids.max())} is outside the mesh {sizes}")
        coords = np.stack(np.unravel_index(ids, dims), axis=1)
        spanned.update(a for a in range(len(dims)) if len(set(coords[:, a].tolist())) > 1)
    return tuple(names[a] for a in sorted(spanned))


def _mesh_sizes(mesh: Any, num_devices: int | None) -> dict[str, int]:
    shape = getattr(mesh, "shape", mesh)
    if not hasattr(shape, "items"):
        raise TypeError(f"expected a Mesh or a mapping axis name -> size, got {type(mesh)}")
    sizes = {str(k): int(v) for k, v in shape.items()}
    total = 1
    for v in sizes.values():
        total *= v
    if num_devices is not None and total != num_devices:
        raise ValueError(f"the mesh {sizes} has {total} devices but the program ran on {num_devices}")
    return sizes


# ----------------------------------------------------------------------------------------------
# Entry points


def comm_report(fn: Any, *args: Any, **kwargs: Any) -> CommReport:
    """Wire bytes of a jitted function called with ``args``/``kwargs``, or of a compiled one.

    The device count is read from the compiled module's header (see
    :func:`comm_report_from_hlo`).

    Args:
      fn: a ``jax.jit``-wrapped function or anything with its ``lower`` (a train step of
        ``qsdp_jax.make_train_step`` / ``qsdp_jax.nnx.make_train_step``), lowered and compiled
        with the arguments; a ``jax.stages.Lowered``, or a ``jax.stages.Compiled`` (then no
        arguments). A plain callable is wrapped in ``jax.jit``.
      *args: the positional arguments of the call, arrays or ``jax.ShapeDtypeStruct``.
      **kwargs: its keyword arguments.

    Returns:
      The :class:`CommReport` of one call.

    Raises:
      TypeError: arguments with a ``Lowered`` or ``Compiled`` ``fn``, or an ``fn`` that is not
        callable.
      NotImplementedError: the backend gives no HLO text for the compiled program.
    """
    import jax

    if isinstance(fn, jax.stages.Compiled):
        if args or kwargs:
            raise TypeError("comm_report: pass no arguments with an already compiled function")
        compiled = fn
    elif isinstance(fn, jax.stages.Lowered):
        if args or kwargs:
            raise TypeError("comm_report: pass no arguments with a Lowered object")
        compiled = fn.compile()
    else:
        if not hasattr(fn, "lower"):
            if not callable(fn):
                raise TypeError(f"comm_report: expected a jitted function, got {type(fn)}")
            fn = jax.jit(fn)
        compiled = fn.lower(*args, **kwargs).compile()
    text = compiled.as_text()
    if text is None:  # jax types as_text() as str | None: a backend with no text view
        raise NotImplementedError(
            "comm_report: this backend gives no HLO text for the compiled step "
            f"({jax.default_backend()}); count the bytes with comm_report_from_hlo on a dump instead"
        )
    return comm_report_from_hlo(text)


def comm_report_from_hlo(hlo_text: str, num_devices: int | None = None, *, strict: bool = False) -> CommReport:
    """Wire bytes per device per step of every collective in an HLO module's text.

    Args:
      hlo_text: the module text, e.g. ``jax.jit(f).lower(*a).compile().as_text()``.
      num_devices: devices meant by an empty ``replica_groups={}``; default: from the
        ``HloModule`` header (``replica_count * num_partitions``), else ``jax.device_count()``.
      strict: raise :class:`UnknownTripCountError` for a loop with collectives but no known
        trip count, instead of counting it once with a warning. Default False.

    Returns:
      The :class:`CommReport`.

    Raises:
      UnknownTripCountError: with ``strict``, a loop with collectives and no known trip count
        (a ``ValueError``).
      ValueError: text that cannot be parsed (no ``ENTRY`` computation, malformed shapes or
        replica groups, a collective without a result shape).
    """
    module = parse_module(hlo_text)
    if num_devices is None:
        num_devices = module.header_devices
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    return _analyze(module, int(num_devices), strict)


# ----------------------------------------------------------------------------------------------
# The report of the collective sites (their wire bytes: qsdp_jax._src.hlo.wire_model)


def _analyze(module: HloModule, num_devices: int, strict: bool) -> CommReport:
    sites, warnings = collective_sites(module, strict)
    collectives: list[Collective] = []
    for site in sites:
        collectives.extend(Collective(**fields) for fields in site_collectives(site, num_devices, warnings))
    return CommReport(tuple(collectives), num_devices, tuple(warnings))
