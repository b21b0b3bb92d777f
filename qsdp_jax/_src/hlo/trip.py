"""A ``while`` loop's trip count read from its condition, where XLA printed none.

XLA:CPU and XLA:GPU annotate a counted loop with ``known_trip_count``; XLA:TPU's compiled text
does not (libtpu 0.0.42.1: the layer loops of the train step carry no trip count). A loop that
JAX's ``scan``/``fori_loop`` made has a condition ``compare(get-tuple-element(param, k),
constant(N)), direction=LT`` and enters with element ``k`` of its init tuple a constant 0 (or a
copy of one); then
its body runs ``N`` times. Anything else is unknown (None).
"""

from __future__ import annotations

import re

from qsdp_jax._src.hlo.reader import HloModule, _attr_value, _Instr

_CONST_RE = re.compile(r"\bconstant\((-?\d+)\)")
_INDEX_RE = re.compile(r"\bindex=(\d+)")


def _by_name(instrs: list[_Instr]) -> dict[str, _Instr]:
    return {i.name: i for i in instrs}


def _int_constant(instr: _Instr | None) -> int | None:
    if instr is None or instr.opcode != "constant":
        return None
    m = _CONST_RE.search(instr.raw)
    return int(m.group(1)) if m else None


def inferred_trip_count(module: HloModule, loop: _Instr) -> int | None:
    """The trip count of ``loop`` (a ``while``) from its condition and init, or None."""
    cond_name = (_attr_value(loop.attrs, "condition") or "").lstrip("%")
    cond = module.computations.get(cond_name)
    if not cond or not loop.operands:
        return None
    root = cond[-1]
    if root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    names = _by_name(cond)
    counter, bound = (names.get(n) for n, _ in root.operands)
    n = _int_constant(bound)
    if n is None or counter is None or counter.opcode != "get-tuple-element":
        return None
    m = _INDEX_RE.search(counter.attrs)
    caller = _by_name(module.computations.get(loop.computation, []))
    init = caller.get(loop.operands[0][0])
    if m is None or init is None or init.opcode != "tuple" or int(m.group(1)) >= len(init.operands):
        return None
    first = caller.get(init.operands[int(m.group(1))][0])
    while first is not None and first.opcode in ("copy", "bitcast") and first.operands:
        first = caller.get(first.operands[0][0])  # XLA:TPU copies the constant into the loop's buffer
    return n if _int_constant(first) == 0 else None
