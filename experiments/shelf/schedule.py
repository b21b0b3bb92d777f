"""What a compiled program's schedule places between each collective's start and its done.

A scheduled HLO module (``compiled.as_text()`` of XLA:GPU or XLA:TPU) lists each computation's
instructions in the order they run. An asynchronous collective is a ``*-start`` and a
``*-done`` (``all-gather-start``, ``all-reduce-start``, ``collective-permute-start``, or an
``async-start`` wrapping a ``reduce-scatter`` / ``all-to-all``; with libtpu's async collective
options, XLA:TPU's chain of fusions that run one collective in steps,
:mod:`qsdp_jax._src.hlo.async_fusion`; between TPU slices, a megascale ``send`` and its
``send-done``, :mod:`qsdp_jax._src.hlo.megascale`); what runs between them is what can hide
its transfer. A synchronous collective (one instruction: what XLA:TPU and XLA:CPU
print for most) hides behind nothing. For every collective this reads the kind, element type,
bytes, the computation it runs in (a ``while`` body is a layer loop), whether it is in the
backward pass (JAX names transposed operations ``transpose(...)`` in the metadata), and the
compute instructions (fusions, dots, convolutions, custom calls) scheduled between its start
and its done, and how many of them are matrix multiplications. A collective is *hidden* when a
matmul runs between its start and done. "Hidden" and "exposed" are read from the program, not
assumed.
"""

from __future__ import annotations

import dataclasses
import re

from qsdp_jax._src.hlo import async_fusion as hlo_async_fusion
from qsdp_jax._src.hlo import megascale as hlo_megascale
from qsdp_jax._src.hlo.reader import HloModule, _attr_value, _Instr, parse_module

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
COMPUTE = ("fusion", "dot", "convolution", "custom-call", "while", "call", "conditional", "scatter", "gather")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Site:
    """One collective of a scheduled program and what runs while it travels."""

    kind: str  # all-gather, reduce-scatter, ...
    name: str  # the instruction's (its start's) name, as comm_report names it
    dtype: str
    bytes: int  # the result's bytes (per device)
    computation: str
    in_loop: bool  # it runs in a ``while`` body (or in what the body calls)
    backward: bool  # JAX's metadata names a transpose: the backward pass
    asynchronous: bool  # a start/done pair (else one synchronous instruction)
    compute_between: int  # compute instructions scheduled between its start and done
    matmuls_between: int  # of them, matrix multiplications (a dot or convolution, or a fusion of one)

    @property
    def hidden(self) -> bool:
        """A matmul runs while it travels: a layer norm's reductions or a counter's update do not
        hide a layer's weights (what XLA:GPU placed between our gathers' start and done)."""
        return self.matmuls_between > 0


def _kind(opcode: str, instr: _Instr, wrapped: dict[str, _Instr]) -> tuple[str, bool] | None:
    """(collective kind, asynchronous) of an instruction that starts a collective, else None."""
    if opcode in COLLECTIVES:
        return opcode, False
    if opcode.endswith("-start") and opcode[: -len("-start")] in COLLECTIVES:
        return opcode[: -len("-start")], True
    if opcode == "async-start":
        callee = (_attr_value(instr.attrs, "calls") or "").lstrip("%")
        if callee in wrapped:
            return wrapped[callee].opcode, True
    return None


def _wrapped_collectives(module: HloModule) -> dict[str, _Instr]:
    """The computations an ``async-start`` runs that hold a collective: name -> the collective."""
    out = {}
    for instrs in module.computations.values():
        for i in instrs:
            callee = (_attr_value(i.attrs, "calls") or "").lstrip("%") if i.opcode == "async-start" else ""
            inner = [c for c in module.computations.get(callee, []) if c.opcode in COLLECTIVES]
            if inner:
                out[callee] = inner[0]
    return out


def _callees(instr: _Instr) -> list[str]:
    names = []
    for key in ("calls", "to_apply", "body", "condition", "branch_computations", "called_computations"):
        v = _attr_value(instr.attrs, key)
        if v:
            names += [c.strip().lstrip("%") for c in v.strip("{}").split(",") if c.strip()]
    return names


def _matmul_computations(module: HloModule) -> set[str]:
    """Computations that hold a dot or a convolution, themselves or through what they call."""
    direct = {
        name for name, instrs in module.computations.items() if any(i.opcode in ("dot", "convolution") for i in instrs)
    }
    changed = True
    while changed:
        changed = False
        for name, instrs in module.computations.items():
            if name not in direct and any(c in direct for i in instrs for c in _callees(i)):
                direct.add(name)
                changed = True
    return direct


def _is_matmul(instr: _Instr, matmuls: set[str]) -> bool:
    if instr.opcode in ("dot", "convolution"):
        return True
    target = re.search(r'custom_call_target="([^"]*)"', instr.raw)
    if target and re.search(r"gemm|matmul|cublas", target.group(1), re.IGNORECASE):
        return True
    return any(c in matmuls for c in _callees(instr))


def _in_loops(module: HloModule) -> set[str]:
    """Computations that run inside a ``while`` body (the body, and what it calls)."""
    todo = [
        (_attr_value(i.attrs, "body") or "").lstrip("%")
        for instrs in module.computations.values()
        for i in instrs
        if i.opcode == "while"
    ]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        todo += [c for i in module.computations[name] for c in _callees(i)]
    return seen


def _leaf(shape) -> tuple[str, int]:
    """(dtype, bytes) of a result shape; an async start's tuple: its last array (the output)."""
    leaves = shape.leaves() if shape is not None else []
    if not leaves:
        return "?", 0
    out = leaves[-1]
    return out.dtype, out.nbytes()


def _started(instrs: list[_Instr], k: int, module: HloModule, wrapped: dict, chains: dict, position: dict):
    """``(kind, asynchronous, result shape, compute between start and done, the collective's
    instruction)`` of the collective ``instrs[k]`` starts (an op, an async start, or the first
    fusion of an XLA:TPU chain), else None."""
    instr = instrs[k]
    inner = hlo_async_fusion.fused_collective(instr, module)
    if inner is not None:  # XLA:TPU: its done is the chain's last fusion; the steps between compute
        last = position[chains[instr.name][-1]]
        return inner.opcode, last > k, inner.shape, [i for i in instrs[k + 1 : last] if i.opcode in COMPUTE], inner
    dcn = hlo_megascale.megascale_kind(instr) if instr.opcode == "send" else None
    kind = (dcn, True) if dcn else _kind(instr.opcode, instr, wrapped)  # a send's done: its send-done
    if kind is None:
        return None
    between = []
    if kind[1]:
        for later in instrs[k + 1 :]:
            if later.opcode.endswith("-done") and any(n == instr.name for n, _ in later.operands):
                break
            if later.opcode in COMPUTE:
                between.append(later)
    callee = (_attr_value(instr.attrs, "calls") or "").lstrip("%")
    op = wrapped.get(callee, instr)
    return kind[0], kind[1], hlo_megascale.sent(instr) if dcn else op.shape, between, op


def sites(hlo_text: str) -> list[Site]:
    """Every collective of the scheduled module ``hlo_text``, in program order per computation."""
    module = parse_module(hlo_text)
    wrapped, looped, matmuls = _wrapped_collectives(module), _in_loops(module), _matmul_computations(module)
    fused = {  # what an XLA:TPU collective fusion calls: counted at the fusion, in its caller
        (_attr_value(i.attrs, "calls") or "").lstrip("%")
        for instrs in module.computations.values()
        for i in instrs
        if hlo_async_fusion.fused_collective(i, module) is not None
    }
    found = []
    for cname, instrs in module.computations.items():
        if cname in wrapped or cname in fused:
            continue  # the inside of an async wrapper or a fusion: counted where it starts
        chains = hlo_async_fusion.chains(module, instrs)
        steps = {n for chain in chains.values() for n in chain[1:]}
        position = {i.name: k for k, i in enumerate(instrs)}
        for k, instr in enumerate(instrs):
            started = None if instr.name in steps else _started(instrs, k, module, wrapped, chains, position)
            if started is None:
                continue
            kind, asynchronous, shape, between, op = started
            m = _OP_NAME.search(op.raw)
            dtype, nbytes = _leaf(shape)
            found.append(
                Site(
                    kind=kind,
                    name=instr.name,
                    dtype=dtype,
                    bytes=nbytes,
                    computation=cname,
                    in_loop=cname in looped,
                    backward=bool(m and "transpose(" in m.group(1)),
                    asynchronous=asynchronous,
                    compute_between=len(between),
                    matmuls_between=sum(_is_matmul(i, matmuls) for i in between),
                )
            )
    return found


def summary(found: list[Site]) -> dict[str, dict[str, int]]:
    """Per pass (``forward loop``, ``backward loop``, ``outside loops``): collectives, how many
    are asynchronous, how many have compute scheduled between start and done, their bytes."""
    out: dict[str, dict[str, int]] = {}
    for s in found:
        key = ("backward loop" if s.backward else "forward loop") if s.in_loop else "outside loops"
        row = out.setdefault(key, {"collectives": 0, "async": 0, "hidden": 0, "bytes": 0, "hidden_bytes": 0})
        row["collectives"] += 1
        row["async"] += s.asynchronous
        row["hidden"] += s.hidden
        row["bytes"] += s.bytes
        row["hidden_bytes"] += s.bytes if s.hidden else 0
    return out
