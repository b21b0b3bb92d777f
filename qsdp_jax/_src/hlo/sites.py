"""Where the collectives of an HLO module run and how often per step: the call graph walked
from the entry computation, ``while`` trip counts multiplied along it (rules in
:mod:`qsdp_jax._src.hlo.reader`'s docstring). :mod:`qsdp_jax.comm` turns each site into wire bytes."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any

from qsdp_jax._src.hlo.async_fusion import continued
from qsdp_jax._src.hlo.megascale import megascale_kind, slice_count
from qsdp_jax._src.hlo.trip import inferred_trip_count
from qsdp_jax._src.hlo.reader import (
    _UNMODELED,
    KINDS,
    HloModule,
    UnknownTripCountError,
    _attr_value,
    _Instr,
    _split_top,
)

__all__ = ["CollectiveSite", "collective_sites"]


_TRIP_RE = re.compile(r'known_trip_count\\?"?\s*:\s*\{\s*\\?"?n\\?"?\s*:\s*\\?"?(\d+)')
_CALL_KEYS = ("calls", "to_apply", "true_computation", "false_computation")
_LIST_KEYS = ("branch_computations", "called_computations")


def _callees(instr: _Instr, module: HloModule) -> list[tuple[str, int | None, str]]:
    """(callee, factor or None if unknown, edge kind) for each computation ``instr`` runs."""
    op = instr.opcode
    if op.endswith("-done") or op.endswith("-update"):
        return []  # the start op owns the async computation
    out: list[tuple[str, int | None, str]] = []
    if op == "while":
        m = _TRIP_RE.search(instr.raw)
        trip = int(m.group(1)) if m else inferred_trip_count(module, instr)
        body = _attr_value(instr.attrs, "body")
        cond = _attr_value(instr.attrs, "condition")
        if body:
            out.append((body.lstrip("%"), trip, "while"))
        if cond:
            out.append((cond.lstrip("%"), None if trip is None else trip + 1, "while"))
        return out
    for key in _CALL_KEYS:
        v = _attr_value(instr.attrs, key)
        if v and not v.startswith("{"):
            out.append((v.lstrip("%"), 1, "conditional" if op == "conditional" else "call"))
    for key in _LIST_KEYS:
        v = _attr_value(instr.attrs, key)
        if v and v.startswith("{"):
            for c in _split_top(v[1:-1]):
                out.append((c.lstrip("%"), 1, "conditional" if op == "conditional" else "call"))
    return out


def _kind_of(opcode: str) -> tuple[str, bool] | None:
    """(kind, is_async_start) for a counted collective opcode, else None."""
    if opcode in KINDS:
        return opcode, False
    if opcode.endswith("-start") and opcode[: -len("-start")] in KINDS:
        return opcode[: -len("-start")], True
    return None


@dataclasses.dataclass
class CollectiveSite:
    """A counted collective instruction: where it is and how often it runs per step.

    ``local`` maps the names in its computation to their result shapes, ``shapes`` maps every
    instruction name of the module to its result shape (first one wins)."""

    instr: _Instr
    kind: str
    is_async_start: bool
    count: int
    trip_count_known: bool
    local: dict
    shapes: dict
    slices: int | None = None  # a collective between TPU slices (hlo_megascale): the slices it spans


def _call_graph(module: HloModule) -> tuple[dict, list[str]]:
    """Edges ``caller -> [(callee, factor, kind, instr)]`` and the post-order from the entry."""
    comps = module.computations
    edges: dict[str, list[tuple[str, int | None, str, _Instr]]] = {}  # a DAG in valid HLO
    for cname, instrs in comps.items():
        steps = continued(module, instrs)  # XLA:TPU's later steps of one fused async collective
        edges[cname] = [
            (callee, f, kind, ins)
            for ins in instrs
            if ins.name not in steps
            for callee, f, kind in _callees(ins, module)
            if callee in comps
        ]
    order: list[str] = []  # post-order from the entry
    seen = {module.entry}
    stack = [(module.entry, iter(edges[module.entry]))]
    while stack:
        node, it = stack[-1]
        for callee, *_ in it:
            if callee not in seen:
                seen.add(callee)
                stack.append((callee, iter(edges[callee])))
                break
        else:
            stack.pop()
            order.append(node)
    return edges, order


def _multipliers(
    module: HloModule, edges: dict, order: list[str], strict: bool, warnings: list[str]
) -> tuple[dict, dict]:
    """How often each computation runs per step, and whether every trip count was known."""
    comps = module.computations
    has_coll: dict[str, bool] = {}
    for c in order:  # callees before callers
        has_coll[c] = any(_kind_of(i.opcode) for i in comps[c]) or any(has_coll[d] for d, *_ in edges[c])
    mult: dict[str, int] = defaultdict(int)
    known: dict[str, bool] = defaultdict(lambda: True)
    mult[module.entry] = 1
    for c in reversed(order):  # callers before callees
        for callee, factor, kind, ins in edges[c]:
            if factor is None:
                if has_coll[callee]:
                    msg = (
                        f"while %{ins.name} in %{c} has no known_trip_count; "
                        f"collectives in %{callee} counted once per enclosing iteration"
                    )
                    if strict:
                        raise UnknownTripCountError(msg)
                    if msg not in warnings:
                        warnings.append(msg)
                    known[callee] = False
                factor = 1
            if kind == "conditional" and has_coll[callee]:
                msg = f"conditional %{ins.name} in %{c}: branch %{callee} counted as if it ran"
                if msg not in warnings:
                    warnings.append(msg)
            mult[callee] += mult[c] * factor
            known[callee] = known[callee] and known[c]
    return mult, known


def collective_sites(module: HloModule, strict: bool = False) -> tuple[list[CollectiveSite], list[str]]:
    """Every collective reachable from the entry computation with its per-step run count,
    and the warnings met on the way (unknown trip counts, conditionals, unmodelled ops)."""
    comps = module.computations
    warnings: list[str] = []
    edges, order = _call_graph(module)
    mult, known = _multipliers(module, edges, order, strict, warnings)
    shapes_global: dict[str, Any] = {}
    for instrs in comps.values():
        for ins in instrs:
            shapes_global.setdefault(ins.name, ins.shape)

    sites: list[CollectiveSite] = []
    slices = None
    for c in reversed(order):
        local = {ins.name: ins.shape for ins in comps[c]}
        for ins in comps[c]:
            dcn = megascale_kind(ins)
            if dcn is not None:  # XLA:TPU between slices: counted at the send
                if slices is None:
                    read = slice_count(module)
                    slices = read or 2
                    if read is None:
                        warnings.append("collectives between TPU slices: the slice count was not read; 2 assumed")
                if ins.opcode == "send":
                    sites.append(CollectiveSite(ins, dcn, False, mult[c], known[c], local, shapes_global, slices))
                continue
            if ins.opcode in _UNMODELED and not (
                ins.opcode in ("send", "recv") and "is_host_transfer=true" in ins.attrs
            ):
                warnings.append(f"%{ins.name} in %{c}: {ins.opcode} is not modelled (0 bytes)")
                continue
            kk = _kind_of(ins.opcode)
            if kk is None:
                continue
            sites.append(CollectiveSite(ins, kk[0], kk[1], mult[c], known[c], local, shapes_global))
    return sites, warnings
