"""XLA:TPU's asynchronous collective fusion, read from its compiled text.

With libtpu's async collective options (``xla_tpu_enable_async_collective_fusion`` and friends,
given as compile options; qsdp_jax does not set them, see :mod:`qsdp_jax._src.collective.overlap`), XLA:TPU runs one collective in steps spread over several fusions
of a computation: a start (a ``fusion`` XLA names ``async-collective-start``), continuations
(compute fusions, e.g. a layer's matmul, that also carry a step of the transfer) and a done
(``async-collective-done``). Each of these fusions calls a computation that holds the same
collective instruction (same opcode, replica groups and result shape), and each after the
first takes an element of the previous one's result tuple. So the collective must be counted
once, at the first fusion of its chain, and what runs between the first and the last fusion of
the chain is what hides the transfer.
"""

from __future__ import annotations

from qsdp_jax._src.hlo.reader import KINDS, HloModule, _attr_value, _Instr

__all__ = ["chains", "continued", "fused_collective"]


def fused_collective(instr: _Instr, module: HloModule) -> _Instr | None:
    """The collective directly inside the computation a ``fusion`` calls, else None."""
    if instr.opcode != "fusion":
        return None
    callee = (_attr_value(instr.attrs, "calls") or "").lstrip("%")
    return next((c for c in module.computations.get(callee, []) if c.opcode in KINDS), None)


def _signature(c: _Instr) -> tuple:
    """The collective's opcode, groups, element type and dimensions: not its layout, whose
    memory-space annotation (``S(1)``) differs between the fusions of one chain."""
    shape = getattr(c.shape, "dtype", None), getattr(c.shape, "dims", None)
    return c.opcode, _attr_value(c.attrs, "replica_groups"), shape if shape != (None, None) else str(c.shape)


def chains(module: HloModule, instrs: list[_Instr]) -> dict[str, list[str]]:
    """The async collective chains of one computation's ``instrs``: the first fusion's name ->
    the names of every fusion of its chain, in program order (a collective fusion that no later
    fusion continues is a chain of one: a synchronous collective)."""
    source = {i.name: i.operands[0][0] for i in instrs if i.opcode == "get-tuple-element" and i.operands}
    head: dict[str, str] = {}  # fusion name -> the first fusion of its chain
    sig: dict[str, tuple] = {}
    out: dict[str, list[str]] = {}
    for i in instrs:
        c = fused_collective(i, module)
        if c is None:
            continue
        sig[i.name] = _signature(c)
        prev = next((source[n] for n, _ in i.operands if source.get(n) in sig and sig[source[n]] == sig[i.name]), None)
        head[i.name] = head[prev] if prev is not None else i.name
        out.setdefault(head[i.name], []).append(i.name)
    return out


def continued(module: HloModule, instrs: list[_Instr]) -> set[str]:
    """The fusions of ``instrs`` that continue or end a chain (not its first): their collective
    is the chain's, already counted at its start."""
    return {name for chain in chains(module, instrs).values() for name in chain[1:]}
