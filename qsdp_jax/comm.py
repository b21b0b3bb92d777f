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
  **Missing trip count:** the loop is counted as running once, every collective under it gets
  ``trip_count_known=False`` and the report gets a line in ``warnings``; pass ``strict=True``
  to raise :class:`UnknownTripCountError` instead. (Only loops that contain collectives matter.)
* Every branch of a ``conditional`` is counted as if it ran (an upper bound; a warning is
  recorded when a branch holds collectives).
* Async collectives are counted once, at their start: ``all-gather-start``,
  ``all-reduce-start``, ``collective-permute-start`` and the ``<op>-start`` sugar XLA prints for
  async-wrapped ``reduce-scatter`` / ``all-to-all`` (result ``((operands), outputs, ...)``).
  ``*-done`` / ``*-update`` ops are never counted and their ``calls=`` are not followed. A
  generic ``async-start(...), calls=%wrapped`` is followed into ``%wrapped``, whose synchronous
  collective is then counted as usual.
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

Limitations
-----------
* The model ignores latency, algorithm choice (tree / 2-D / NVLS), and the
  cross-replica-and-partition mode where a group of replicas spans several partitions.
* ``ragged-all-to-all``, ``collective-broadcast``, ``send`` and ``recv`` are not modelled; they
  are reported in ``warnings``.
* On CPU, XLA upcasts bf16/f16 collectives to f32 (the HLO shows ``f32`` all-gathers of
  converted bf16 data); the report shows what the compiled program moves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from fractions import Fraction
from typing import Any, Callable

__all__ = [
    "Collective",
    "CommReport",
    "UnknownTripCountError",
    "comm_report",
    "comm_report_from_hlo",
    "parse_replica_groups",
    "DTYPE_BITS",
]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

#: Bits per element of each HLO element type.
DTYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8,
    "f4e2m1fn": 4, "f6e2m3fn": 6, "f6e3m2fn": 6,
    "token": 0,
}

_UNMODELED = ("ragged-all-to-all", "collective-broadcast", "send", "recv")


class UnknownTripCountError(ValueError):
    """A ``while`` loop holding collectives has no ``known_trip_count`` (with ``strict=True``)."""


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


@dataclasses.dataclass(frozen=True)
class CommReport:
    """All collectives of one compiled program with their per-device, per-step wire bytes."""

    collectives: tuple[Collective, ...]
    num_devices: int
    warnings: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> float:
        """Bytes one device sends per step, all collectives together."""
        return float(sum(c.bytes_on_wire for c in self.collectives))

    def by_kind(self) -> dict[str, float]:
        """Wire bytes summed by collective kind."""
        return self._sum(lambda c: c.kind)

    def by_dtype(self) -> dict[str, float]:
        """Wire bytes summed by element type."""
        return self._sum(lambda c: c.dtype)

    def by_kind_dtype(self) -> dict[tuple[str, str], float]:
        """Wire bytes summed by ``(kind, dtype)``."""
        return self._sum(lambda c: (c.kind, c.dtype))

    def _sum(self, key: Callable[[Collective], Any]) -> dict:
        out: dict = defaultdict(float)
        for c in self.collectives:
            out[key(c)] += c.bytes_on_wire
        return dict(out)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (``by_kind_dtype`` keys are ``"kind/dtype"``)."""
        return {
            "total_bytes": self.total_bytes,
            "num_devices": self.num_devices,
            "by_kind": self.by_kind(),
            "by_dtype": self.by_dtype(),
            "by_kind_dtype": {f"{k}/{d}": v for (k, d), v in self.by_kind_dtype().items()},
            "collectives": [dataclasses.asdict(c) for c in self.collectives],
            "warnings": list(self.warnings),
        }

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.as_dict())``."""
        return json.dumps(self.as_dict(), **kwargs)

    def table(self, per_op: bool = False) -> str:
        """A text table of wire bytes per (kind, dtype), or per instruction with ``per_op``."""
        total = self.total_bytes
        if per_op:
            header = ("computation/name", "kind", "dtype", "N", "count", "payload B", "wire B")
            rows = [
                (
                    f"{c.computation}/{c.name}",
                    c.kind,
                    c.dtype,
                    str(c.group_size),
                    str(c.count) + ("" if c.trip_count_known else "?"),
                    str(c.payload_bytes),
                    _fmt_num(c.bytes_on_wire),
                )
                for c in self.collectives
            ]
            last = ("total", "", "", "", "", "", _fmt_num(total))
            left = 3
        else:
            header = ("kind", "dtype", "ops", "calls/step", "wire B/step", "")
            agg: dict[tuple[str, str], list] = {}
            for c in self.collectives:
                a = agg.setdefault((c.kind, c.dtype), [0, 0, 0.0])
                a[0] += 1
                a[1] += c.count
                a[2] += c.bytes_on_wire
            rows = [
                (k, d, str(n), str(calls), _fmt_num(b), _human(b))
                for (k, d), (n, calls, b) in sorted(agg.items())
            ]
            last = ("total", "", "", "", _fmt_num(total), _human(total))
            left = 2
        widths = [max(len(r[i]) for r in (header, *rows, last)) for i in range(len(header))]

        def line(r: tuple[str, ...]) -> str:
            cells = (
                x.ljust(w) if i < left else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths))
            )
            return "  ".join(cells).rstrip()

        sep = "-" * len(line(header))
        out = [line(header), sep, *(line(r) for r in rows), sep, line(last)]
        out += [f"warning: {w}" for w in self.warnings]
        return "\n".join(out)


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def _human(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{_fmt_num(x)} B"


# ----------------------------------------------------------------------------------------------
# Entry points


def comm_report(fn: Any, *args: Any, **kwargs: Any) -> CommReport:
    """Wire bytes of a jitted function called with ``args``/``kwargs``, or of a compiled one.

    ``fn`` may be a ``jax.jit``-wrapped function (lowered and compiled with the arguments, which
    may be arrays or ``jax.ShapeDtypeStruct``), a ``jax.stages.Lowered``, or a
    ``jax.stages.Compiled`` (then no arguments). A plain callable is wrapped in ``jax.jit``.
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
    if not isinstance(text, str):  # defensive: some versions return one text per module
        text = "\n".join(text)
    return comm_report_from_hlo(text)


def comm_report_from_hlo(
    hlo_text: str, num_devices: int | None = None, *, strict: bool = False
) -> CommReport:
    """Wire bytes per device per step of every collective in an HLO module's text.

    Args:
      hlo_text: the module text, e.g. ``jax.jit(f).lower(*a).compile().as_text()``.
      num_devices: devices meant by an empty ``replica_groups={}``; default: from the
        ``HloModule`` header (``replica_count * num_partitions``), else ``jax.device_count()``.
      strict: raise :class:`UnknownTripCountError` for a loop with collectives but no known
        trip count, instead of counting it once with a warning.
    """
    module = _parse_module(hlo_text)
    if num_devices is None:
        num_devices = module.header_devices
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    return _analyze(module, int(num_devices), strict)


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
    elements: tuple[Any, ...]

    def leaves(self) -> list[_Array]:
        return [leaf for e in self.elements for leaf in e.leaves()]


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _parse_shape(s: str, i: int = 0) -> tuple[_Array | _Tuple, int]:
    """Parse a shape starting at ``s[i]`` (after whitespace); return it and the end index."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i < len(s) and s[i] == "(":
        i += 1
        elements = []
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
        raise ValueError(f"no shape at {s[i:i + 40]!r}")
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
    raise ValueError(f"unbalanced brackets in {s[i:i + 80]!r}")


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


def parse_replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Device groups of a ``replica_groups`` attribute value.

    ``text`` is what follows ``replica_groups=``: ``{{0,1},{2,3}}``, ``{}`` (one group of all
    ``num_devices``), or the iota form ``[G,S]<=[d0,d1,...]`` optionally followed by
    ``T(perm)``: ``arange(prod(d)).reshape(d).transpose(perm).reshape(G, S)``.
    """
    text = text.strip()
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
    groups = tuple(
        tuple(int(x) for x in g.split(",") if x.strip())
        for g in re.findall(r"\{([^{}]*)\}", text[1:-1])
    )
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
class _Module:
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


def _parse_module(text: str) -> _Module:
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
                    header_devices = (int(nr.group(1)) if nr else 1) * (
                        int(npart.group(1)) if npart else 1
                    )
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
    return _Module(computations, entry, header_devices)


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


# ----------------------------------------------------------------------------------------------
# Call graph and counting

_TRIP_RE = re.compile(
    r'known_trip_count\\?"?\s*:\s*\{\s*\\?"?n\\?"?\s*:\s*\\?"?(\d+)'
)
_CALL_KEYS = ("calls", "to_apply", "true_computation", "false_computation")
_LIST_KEYS = ("branch_computations", "called_computations")


def _callees(instr: _Instr) -> list[tuple[str, int | None, str]]:
    """(callee, factor or None if unknown, edge kind) for each computation ``instr`` runs."""
    op = instr.opcode
    if op.endswith("-done") or op.endswith("-update"):
        return []  # the start op owns the async computation
    out: list[tuple[str, int | None, str]] = []
    if op == "while":
        m = _TRIP_RE.search(instr.raw)
        trip = int(m.group(1)) if m else None
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


def _analyze(module: _Module, num_devices: int, strict: bool) -> CommReport:
    comps = module.computations
    # Call graph (DAG in valid HLO).
    edges: dict[str, list[tuple[str, int | None, str, _Instr]]] = {}
    for cname, instrs in comps.items():
        edges[cname] = [
            (callee, f, kind, ins)
            for ins in instrs
            for callee, f, kind in _callees(ins)
            if callee in comps
        ]

    order: list[str] = []  # post-order from the entry
    seen: set[str] = set()

    def visit(c: str) -> None:
        stack = [(c, iter(edges[c]))]
        seen.add(c)
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

    visit(module.entry)

    def has_coll_local(c: str) -> bool:
        return any(_kind_of(i.opcode) for i in comps[c])

    has_coll: dict[str, bool] = {}
    for c in order:  # callees before callers
        has_coll[c] = has_coll_local(c) or any(has_coll[d] for d, *_ in edges[c])

    warnings: list[str] = []
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

    shapes_global: dict[str, Any] = {}
    for instrs in comps.values():
        for ins in instrs:
            shapes_global.setdefault(ins.name, ins.shape)

    collectives: list[Collective] = []
    for c in reversed(order):
        local = {ins.name: ins.shape for ins in comps[c]}
        for ins in comps[c]:
            if ins.opcode in _UNMODELED and not (
                ins.opcode in ("send", "recv") and "is_host_transfer=true" in ins.attrs
            ):
                warnings.append(f"%{ins.name} in %{c}: {ins.opcode} is not modelled (0 bytes)")
                continue
            kk = _kind_of(ins.opcode)
            if kk is None:
                continue
            collectives.extend(
                _collective(ins, kk[0], kk[1], num_devices, mult[c], known[c], local,
                            shapes_global, warnings)
            )
    return CommReport(tuple(collectives), num_devices, tuple(warnings))


def _resolve_operands(ins: _Instr, local: dict, global_: dict) -> list[_Array] | None:
    leaves: list[_Array] = []
    for name, inline in ins.operands:
        shape = inline if inline is not None else local.get(name, global_.get(name))
        if shape is None:
            return None
        leaves.extend(shape.leaves())
    return leaves


def _collective(
    ins: _Instr,
    kind: str,
    is_start: bool,
    num_devices: int,
    count: int,
    known: bool,
    local: dict,
    global_: dict,
    warnings: list[str],
) -> list[Collective]:
    if ins.shape is None:
        raise ValueError(f"collective %{ins.name} has no result shape: {ins.raw[:200]}")
    # Inputs and outputs as lists of array leaves.
    inputs: list[_Array] | None
    if is_start and kind != "all-reduce":
        # all-gather-start: (operand(s), output(s)); collective-permute-start: (in, out, ...);
        # async sugar reduce-scatter-start / all-to-all-start: ((operands), output(s), ...).
        if not isinstance(ins.shape, _Tuple) or len(ins.shape.elements) < 2:
            raise ValueError(f"unexpected result shape of {ins.opcode} %{ins.name}")
        inputs = ins.shape.elements[0].leaves()
        outputs = ins.shape.elements[1].leaves()
    else:
        outputs = ins.shape.leaves()
        inputs = outputs if kind == "all-reduce" else _resolve_operands(ins, local, global_)

    if kind == "collective-permute":
        pairs_text = _attr_value(ins.attrs, "source_target_pairs") or "{}"
        pairs = [
            tuple(int(x) for x in p.split(","))
            for p in re.findall(r"\{([^{}]*)\}", pairs_text[1:-1])
            if p.strip()
        ]
        n = len({d for p in pairs for d in p})
        moves = any(p[0] != p[1] for p in pairs)
        factor = Fraction(1 if moves else 0)
        leaves = outputs
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
            warnings.append(
                f"%{ins.name} in %{ins.computation}: operand shape not found, derived from result"
            )
            leaves = outputs
            if kind == "reduce-scatter":
                leaves = [dataclasses.replace(a, dims=(*a.dims, n)) for a in outputs]

    by_dtype: dict[str, int] = {}
    for leaf in leaves:
        by_dtype[leaf.dtype] = by_dtype.get(leaf.dtype, 0) + leaf.nbytes()
    by_dtype.pop("token", None)
    return [
        Collective(
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
        )
        for dtype, payload in by_dtype.items()
    ]

