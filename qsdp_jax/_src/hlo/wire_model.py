"""The wire-byte model of :mod:`qsdp_jax.comm`: the bytes one device puts on the wire for one
collective site of the HLO (see the table in that module's docstring).

:func:`site_collectives` takes a :class:`~qsdp_jax._src.hlo.sites.CollectiveSite` (an instruction
with its trip count and the shapes in scope, from :func:`~qsdp_jax._src.hlo.sites.collective_sites`),
finds its payload (result or operands, by kind), its replica groups and group size, and gives the
fields of one ``Collective`` per element type; :mod:`qsdp_jax.comm` builds the report of them.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any

from qsdp_jax._src.hlo.reader import _attr_value, _Tuple, parse_replica_groups
from qsdp_jax._src.hlo.megascale import dcn_terms
from qsdp_jax._src.hlo.sites import CollectiveSite


def _resolve_operands(ins, local: dict, global_: dict) -> list | None:
    """The array leaves of ``ins``'s operands (inline shapes, else looked up by name in its
    computation, then the module), or None when one is not found."""
    leaves: list = []
    for name, inline in ins.operands:
        shape = inline if inline is not None else local.get(name, global_.get(name))
        if shape is None:
            return None
        leaves.extend(shape.leaves())
    return leaves


def site_collectives(site: CollectiveSite, num_devices: int, warnings: list[str]) -> list[dict[str, Any]]:
    """The wire bytes of one collective site by the model of :mod:`qsdp_jax.comm`'s docstring:
    one dict of :class:`qsdp_jax.comm.Collective`'s fields per element type of its payload.

    ``warnings`` gets a line where the operand shape had to be derived from the result.

    Raises:
      ValueError: a collective without a result shape, or an async start of unexpected shape.
    """
    if site.slices is not None:  # between TPU slices, a megascale send (hlo_megascale)
        kind, (leaves, factor, n, groups) = site.kind, dcn_terms(site.instr, site.kind, site.slices)
    else:
        kind, leaves, factor, n, groups = _ring_terms(site, num_devices, warnings)
    ins, count, known = site.instr, site.count, site.trip_count_known
    by_dtype: dict[str, int] = {}
    for leaf in leaves:
        by_dtype[leaf.dtype] = by_dtype.get(leaf.dtype, 0) + leaf.nbytes()
    by_dtype.pop("token", None)
    return [
        dict(
            kind=kind,
            dtype=dtype,
            bytes_on_wire=float(Fraction(payload * count) * factor),
            group_size=n,
            count=count,
            payload_bytes=payload,
            name=ins.name,
            computation=ins.computation,
            opcode=ins.opcode,
            trip_count_known=known,
            replica_groups=groups,
        )
        for dtype, payload in by_dtype.items()
    ]


def _ring_terms(site: CollectiveSite, num_devices: int, warnings: list[str]):
    """``(kind, payload leaves, factor, group size, groups)`` of a collective on the devices'
    own links, by the table of :mod:`qsdp_jax.comm`."""
    ins, kind, is_start = site.instr, site.kind, site.is_async_start
    local, global_ = site.local, site.shapes
    if kind == "all-reduce" and ins.computation.startswith("all-reduce-scatter"):
        # XLA:TPU prints a reduce-scatter as a fusion calling %all-reduce-scatter*: an all-reduce
        # then each device's dynamic slice, which the chip runs as one reduce-scatter
        kind = "reduce-scatter"
    if ins.shape is None:
        raise ValueError(f"collective %{ins.name} has no result shape: {ins.raw[:200]}")
    # Inputs and outputs as lists of array leaves.
    inputs: list | None
    if is_start and kind != "all-reduce":
        # all-gather-start: (operand(s), output(s)); collective-permute-start: (in, out, ...);
        # async sugar reduce-scatter-start / all-to-all-start: ((operands), output(s), ...).
        if not isinstance(ins.shape, _Tuple) or len(ins.shape.elements) < 2:
            raise ValueError(f"unexpected result shape of {ins.opcode} %{ins.name}")
        inputs = ins.shape.elements[0].leaves()
        outputs = ins.shape.elements[1].leaves()
    else:
        outputs = ins.shape.leaves()
        inputs = outputs if ins.opcode.startswith("all-reduce") else _resolve_operands(ins, local, global_)

    if kind == "collective-permute":
        pairs_text = _attr_value(ins.attrs, "source_target_pairs") or "{}"
        pairs = [
            tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{([^{}]*)\}", pairs_text[1:-1]) if p.strip()
        ]
        n = len({d for p in pairs for d in p})
        moves = any(p[0] != p[1] for p in pairs)
        factor = Fraction(1 if moves else 0)
        leaves = outputs
        groups = tuple(p for p in pairs if p[0] != p[1])
    else:
        rg = _attr_value(ins.attrs, "replica_groups")
        groups = parse_replica_groups(rg if rg is not None else "{}", num_devices)
        n = max(len(g) for g in groups)
        factor = Fraction(0) if n <= 1 else Fraction(n - 1, n)
        if kind == "all-reduce":
            factor *= 2
        if kind == "all-gather":
            leaves = outputs
        elif inputs is not None:
            leaves = inputs
        else:  # operand shape not found: the full input is result * N (reduce-scatter)
            warnings.append(f"%{ins.name} in %{ins.computation}: operand shape not found, derived from result")
            leaves = outputs
            if kind == "reduce-scatter":
                leaves = [dataclasses.replace(a, dims=(*a.dims, n)) for a in outputs]

    return kind, leaves, factor, n, tuple(groups)
