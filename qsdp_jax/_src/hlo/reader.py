"""Reading XLA's optimized HLO text: shapes, replica groups, computations and instructions.
:mod:`qsdp_jax._src.hlo.sites` finds where the collectives run and how often; :mod:`qsdp_jax.comm`
turns that into wire bytes.

How the HLO is read
-------------------
* Computations are walked from the ``ENTRY`` computation along ``body=`` / ``condition=``
  (a ``while``), ``calls=`` (fusion, call, custom-call, ``async-start``), ``to_apply=``,
  ``branch_computations=`` / ``true_computation=`` / ``false_computation=`` (conditional) and
  ``called_computations=``. Unreachable computations are ignored. A computation reached from
  several places gets the sum of their multipliers.
* A ``while`` body runs ``n`` times where ``n`` is XLA's annotation
  ``backend_config={..."known_trip_count":{"n":"4"}...}`` (what XLA prints on the while op;
  the escaped, quoted form of ``backend_config`` is read too); its condition runs ``n+1`` times.
  XLA:TPU prints no trip count: there ``n`` is read from the condition, ``counter < N`` with the
  counter starting at a constant 0 (``hlo_trip.inferred_trip_count``).
  **Missing trip count:** the loop is counted as running once, every collective under it gets
  ``trip_count_known=False`` and the report gets a line in ``warnings``; pass ``strict=True``
  to raise :class:`UnknownTripCountError` instead. (Only loops that contain collectives matter.)
* XLA:TPU prints a reduce-scatter as a fusion whose computation, named ``all-reduce-scatter*``,
  holds an ``all-reduce`` and a dynamic slice per device: that all-reduce is counted as the
  reduce-scatter the chip runs (``wire_model``).
* Every branch of a ``conditional`` is counted as if it ran (an upper bound; a warning is
  recorded when a branch holds collectives).
* Async collectives are counted once, at their start: ``all-gather-start``,
  ``all-reduce-start``, ``collective-permute-start`` and the ``<op>-start`` sugar XLA prints for
  async-wrapped ``reduce-scatter`` / ``all-to-all`` (result ``((operands), outputs, ...)``).
  ``*-done`` / ``*-update`` ops are never counted and their ``calls=`` are not followed. A
  generic ``async-start(...), calls=%wrapped`` is followed into ``%wrapped``, whose synchronous
  collective is then counted as usual. XLA:TPU's async collective fusion runs one collective in
  steps over a chain of fusions (:mod:`qsdp_jax._src.hlo.async_fusion`): only the chain's first
  fusion is followed.
* Sizes come from the shapes printed in the HLO. An operand printed as ``%name`` only (JAX 0.10 /
  current XLA) is looked up in a table of every instruction's result shape; inline operand
  shapes (``f32[8]{0} %x``, older printers) are read directly. If an operand cannot be found
  the size is derived from the result (reduce-scatter: result * N) and a warning is recorded.
  Layouts (``{1,0}``, ``{0:T(8,128)}``) are ignored except an element size ``E(n)`` for
  sub-byte types (``s4`` etc.), which otherwise take one byte per element (unpacked).
* Replica groups: explicit ``{{0,1,2,3},{4,5,6,7}}``, iota ``[2,4]<=[8]`` and
  ``[2,4]<=[4,2]T(1,0)``, and ``{}`` (all devices). For ``{}`` the device count is
  ``num_devices`` if given, else ``replica_count * num_partitions`` from the ``HloModule``
  header line, else :func:`jax.device_count`. The group size is the largest group.
* A collective whose operands have several element types (e.g. a combined all-gather of f32 and
  bf16 buffers) gives one :class:`Collective` per element type, so sums by dtype are exact.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

__all__ = [
    "DTYPE_BITS",
    "KINDS",
    "HloModule",
    "UnknownTripCountError",
    "parse_module",
    "parse_replica_groups",
]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

#: Bits per element of each HLO element type.
DTYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f8e5m2": 8,
    "f8e4m3": 8,
    "f8e4m3fn": 8,
    "f8e4m3b11fnuz": 8,
    "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8,
    "f8e3m4": 8,
    "f8e8m0fnu": 8,
    "f4e2m1fn": 4,
    "f6e2m3fn": 6,
    "f6e3m2fn": 6,
    "token": 0,
}

_UNMODELED = ("ragged-all-to-all", "collective-broadcast", "send", "recv")


class UnknownTripCountError(ValueError):
    """A ``while`` loop holding collectives has no ``known_trip_count`` (with ``strict=True``)."""


# ----------------------------------------------------------------------------------------------
# Shapes


@dataclasses.dataclass(frozen=True)
class _Array:
    dtype: str
    dims: tuple[int, ...]
    layout: str

    def leaves(self) -> list[_Array]:
        return [self]

    def nbytes(self) -> int:
        if self.dtype not in DTYPE_BITS:
            raise ValueError(
                f"unknown HLO element type {self.dtype!r} in shape "
                f"{self.dtype}[{','.join(map(str, self.dims))}]; known: {sorted(DTYPE_BITS)}"
            )
        bits = DTYPE_BITS[self.dtype]
        if 0 < bits < 8:
            m = re.search(r"E\((\d+)\)", self.layout)
            bits = int(m.group(1)) if m else 8
        return math.ceil(math.prod(self.dims) * bits / 8)


@dataclasses.dataclass(frozen=True)
class _Tuple:
    elements: tuple[_Array | _Tuple, ...]

    def leaves(self) -> list[_Array]:
        return [leaf for e in self.elements for leaf in e.leaves()]


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _parse_shape(s: str, i: int = 0) -> tuple[_Array | _Tuple, int]:
    """Parse a shape starting at ``s[i]`` (after whitespace); return it and the end index."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i < len(s) and s[i] == "(":
        i += 1
        elements: list[_Array | _Tuple] = []
        while True:
            while i < len(s) and (s[i].isspace() or s[i] == ","):
                i += 1
            if i >= len(s):
                raise ValueError(f"unterminated tuple shape in {s!r}")
            if s[i] == ")":
                return _Tuple(tuple(elements)), i + 1
            e, i = _parse_shape(s, i)
            elements.append(e)
    m = _ARRAY_RE.match(s, i)
    if not m:
        raise ValueError(f"no shape at {s[i : i + 40]!r}")
    dims = []
    for d in m.group(2).split(","):
        d = d.strip().lstrip("<=").strip()
        if not d:
            continue
        if not d.isdigit():
            raise ValueError(f"unsupported dimension {d!r} in shape {m.group(0)!r}")
        dims.append(int(d))
    i = m.end()
    layout = ""
    if i < len(s) and s[i] == "{":
        j = _match_close(s, i)
        layout, i = s[i + 1 : j], j + 1
    return _Array(m.group(1), tuple(dims), layout), i


_OPEN = {"(": ")", "{": "}", "[": "]"}


def _match_close(s: str, i: int) -> int:
    """Index of the bracket closing ``s[i]`` (strings already removed)."""
    depth = 0
    for j in range(i, len(s)):
        c = s[j]
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced brackets in {s[i : i + 80]!r}")


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for j, c in enumerate(s):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


# ----------------------------------------------------------------------------------------------
# Replica groups


# ``mesh['a'=4,'b'=2] {'a'}``, optionally with the mesh's devices in between:
# ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}``
_MESH_GROUPS = r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^()]*(?:\([^()]*\))?)\))?\s*\{([^}]*)\}"


def _iota(text: str) -> Any:
    """Device ids of the iota form ``[d0,d1,...]`` with an optional ``T(perm)``, flattened."""
    import numpy as np

    m = re.fullmatch(r"\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?", text.strip())
    if not m:
        raise ValueError(f"cannot parse iota device ids {text!r}")
    dims = [int(x) for x in m.group(1).split(",")]
    perm = [int(x) for x in m.group(2).split(",")] if m.group(2) else list(range(len(dims)))
    if sorted(perm) != list(range(len(dims))):
        raise ValueError(f"inconsistent iota device ids {text!r}")
    return np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(-1)


def _mesh_replica_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """The mesh form ``mesh['a'=8,'b'=1] {'a'}`` (newer XLA, for collectives GSPMD inserts): the
    devices of the mesh that differ only along the listed axes form one group. The mesh is an
    iota one, or has the ``device_ids=(...)`` given between the two (jax 0.10.2 prints that for
    the step's reductions on a ``(replica, fsdp)`` mesh)."""
    m = re.fullmatch(_MESH_GROUPS, text)
    if not m:
        raise ValueError(f"cannot parse mesh replica groups {text!r}")
    axes = [
        (a.strip().strip("'\""), int(n)) for a, n in (item.split("=") for item in m.group(1).split(",") if item.strip())
    ]
    listed = [a.strip().strip("'\"") for a in m.group(3).split(",") if a.strip()]
    names = [a for a, _ in axes]
    if any(a not in names for a in listed):
        raise ValueError(f"mesh replica groups {text!r} name an axis the mesh does not have")
    import numpy as np

    total = math.prod(n for _, n in axes)
    ids = _iota(m.group(2)) if m.group(2) else np.arange(total)
    if ids.size != total:
        raise ValueError(f"mesh replica groups {text!r}: {ids.size} device ids for {total} positions")
    ids = ids.reshape([n for _, n in axes])
    order = [i for i, a in enumerate(names) if a not in listed] + [names.index(a) for a in listed]
    size = math.prod(n for a, n in axes if a in listed)
    ids = ids.transpose(order).reshape(-1, size)
    return tuple(tuple(int(x) for x in row) for row in ids)


def parse_replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Device groups of a ``replica_groups`` attribute value.

    ``text`` is what follows ``replica_groups=``: ``{{0,1},{2,3}}``, ``{}`` (one group of all
    ``num_devices``), or the iota form ``[G,S]<=[d0,d1,...]`` optionally followed by
    ``T(perm)``: ``arange(prod(d)).reshape(d).transpose(perm).reshape(G, S)``.
    """
    text = text.strip()
    if text.startswith("mesh["):
        return _mesh_replica_groups(text)
    if text.startswith("["):
        m = re.fullmatch(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?", text)
        if not m:
            raise ValueError(f"cannot parse iota replica groups {text!r}")
        shape = [int(x) for x in m.group(1).split(",")]
        reshape = [int(x) for x in m.group(2).split(",")]
        perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else list(range(len(reshape)))
        if math.prod(shape) != math.prod(reshape) or sorted(perm) != list(range(len(reshape))):
            raise ValueError(f"inconsistent iota replica groups {text!r}")
        import numpy as np

        ids = np.arange(math.prod(reshape)).reshape(reshape).transpose(perm)
        ids = ids.reshape(shape[0], -1) if len(shape) > 1 else ids.reshape(1, -1)
        return tuple(tuple(int(x) for x in row) for row in ids)
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"cannot parse replica groups {text!r}")
    groups = tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([^{}]*)\}", text[1:-1]))
    groups = tuple(g for g in groups if g)
    if not groups:
        return (tuple(range(num_devices)),)
    return groups


def _attr_value(attrs: str, key: str) -> str | None:
    """The text of ``key=<value>`` in an attribute list (bracketed values kept whole)."""
    m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", attrs)
    if not m:
        return None
    i = m.end()
    if i < len(attrs) and attrs[i] == "{":
        return attrs[i : _match_close(attrs, i) + 1]
    if attrs.startswith("mesh[", i):  # mesh replica groups, device ids included
        m3 = re.match(_MESH_GROUPS, attrs[i:])
        if m3:
            return m3.group(0)
    if i < len(attrs) and attrs[i] == "[":  # iota replica groups
        m2 = re.match(r"\[[^\]]*\]\s*<=\s*\[[^\]]*\](?:\s*T\([^)]*\))?", attrs[i:])
        if m2:
            return m2.group(0)
    return _split_top(attrs[i:])[0] if attrs[i:].strip() else ""


# ----------------------------------------------------------------------------------------------
# Module parsing


@dataclasses.dataclass
class _Instr:
    name: str
    shape: _Array | _Tuple | None
    opcode: str
    operands: list[tuple[str, Any]]  # (name, inline shape or None)
    attrs: str  # strings removed
    raw: str  # the statement as printed (for backend_config)
    computation: str


@dataclasses.dataclass
class HloModule:
    computations: dict[str, list[_Instr]]
    entry: str
    header_devices: int | None


_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->.*)?\{$")
_INSTR_START_RE = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?![{\"])")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")


def _depth(s: str) -> int:
    return sum(s.count(c) for c in "({[") - sum(s.count(c) for c in ")}]")


def parse_module(text: str) -> HloModule:
    computations: dict[str, list[_Instr]] = {}
    entry: str | None = None
    header_devices = None
    current: str | None = None
    stmt_raw: list[str] = []
    stmt_clean: list[str] = []
    depth = 0

    def flush() -> None:
        if stmt_clean and current is not None:
            instr = _parse_instr(" ".join(stmt_clean), " ".join(stmt_raw), current)
            if instr is not None:
                computations[current].append(instr)
        stmt_raw.clear()
        stmt_clean.clear()

    for raw_line in text.splitlines():
        raw = _COMMENT_RE.sub("", raw_line).strip()
        if not raw:
            continue
        clean = _STRING_RE.sub('""', raw)
        if current is None:
            if clean.startswith("HloModule"):
                nr = re.search(r"\breplica_count=(\d+)", clean)
                npart = re.search(r"\bnum_partitions=(\d+)", clean)
                if nr or npart:
                    header_devices = (int(nr.group(1)) if nr else 1) * (int(npart.group(1)) if npart else 1)
                continue
            m = _COMP_RE.match(clean)
            if m:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
                depth = 0
            continue
        continuing = stmt_clean and (depth > 0 or stmt_clean[-1].endswith(","))
        if not continuing and clean.startswith("}"):
            flush()
            current = None
            continue
        if not continuing and _INSTR_START_RE.match(clean):
            flush()
        stmt_raw.append(raw)
        stmt_clean.append(clean)
        depth = _depth(" ".join(stmt_clean))
    flush()
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return HloModule(computations, entry, header_devices)


def _parse_instr(clean: str, raw: str, computation: str) -> _Instr | None:
    m = _INSTR_START_RE.match(clean)
    if not m:
        return None
    name, i = m.group(1), m.end()
    shape = None
    try:
        shape, i = _parse_shape(clean, i)
    except ValueError:
        pass  # hand-written HLO may omit the result shape
    mo = _OPCODE_RE.match(clean, i)
    if not mo:
        return None
    opcode = mo.group(1)
    open_i = mo.end() - 1
    close_i = _match_close(clean, open_i)
    operands = []
    for op in _split_top(clean[open_i + 1 : close_i]):
        op_shape = None
        if " " in op:
            try:
                op_shape, _ = _parse_shape(op)
            except ValueError:
                op_shape = None
        operands.append((op.split()[-1].lstrip("%"), op_shape))
    attrs = clean[close_i + 1 :].lstrip(", ")
    return _Instr(name, shape, opcode, operands, attrs, raw, computation)
