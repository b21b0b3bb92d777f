"""XLA:TPU's collectives between slices (a multislice job, over the data-center network).

Compiled for several TPU slices (``get_topology_desc(..., num_slices=S)``), a collective whose
replica groups cross slices leaves the chip as a host transfer: a ``send`` / ``recv`` pair with
``frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",
_xla_host_transfer_rendezvous="all-gather.8_0"}`` (the rendezvous names the collective it
implements: ``all-gather``, ``all-reduce``, ``all_to_all``, ...), what is left inside each slice
a collective of its own over the slice's chips. The ``send`` carries this chip's part: an
all-gather's own part (the ``recv`` gets ``S`` of them), an all-to-all's ``S`` chunks, an
all-reduce's whole buffer. Bytes on the data-center network per chip, for ``S`` slices:
all-gather ``(S - 1) x part``, all-to-all and reduce-scatter ``(S - 1) / S x sent``, all-reduce
``2 (S - 1) / S x sent``, collective-permute ``sent``. ``S`` is read from an all-gather's
``recv`` (``S`` parts) or an all-to-all's ``send`` (``S`` chunks) of the module.
"""

from __future__ import annotations

import re
from fractions import Fraction

from qsdp_jax._src.hlo.reader import KINDS, HloModule, _Instr, _Tuple

__all__ = ["dcn_terms", "megascale_kind", "sent", "slice_count"]

_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')
_TIMES = {"all-to-all": 1, "reduce-scatter": 1, "all-reduce": 2}  # x (S - 1) / S of what it sends


def megascale_kind(ins: _Instr) -> str | None:
    """The collective kind a ``send`` / ``recv`` to the megascale runtime implements, else None."""
    if ins.opcode not in ("send", "recv") or "xla_megascale_runtime" not in ins.raw:
        return None
    m = _RENDEZVOUS.search(ins.raw)
    kind = m.group(1).rsplit(".", 1)[0].replace("_", "-") if m else ""
    return kind if kind in KINDS else None


def sent(ins: _Instr):
    """The array a ``send`` or ``recv`` carries (its result tuple's first element)."""
    return ins.shape.elements[0] if isinstance(ins.shape, _Tuple) and ins.shape.elements else None


def slice_count(module: HloModule) -> int | None:
    """The slices the module's megascale collectives span: an all-gather's ``recv`` over its
    ``send`` (one part per slice), or the leading dimension of an all-to-all's ``send`` (one
    chunk per slice); None if neither is there."""
    parts: dict[str, int] = {}  # an all-gather's rendezvous -> the bytes of its send
    for ins in (i for instrs in module.computations.values() for i in instrs):
        kind, arr, m = megascale_kind(ins), sent(ins), _RENDEZVOUS.search(ins.raw)
        if kind is None or arr is None or m is None:
            continue
        if kind == "all-to-all" and ins.opcode == "send" and arr.dims:
            return int(arr.dims[0])
        if kind == "all-gather" and ins.opcode == "send":
            parts[m.group(1)] = arr.nbytes()
        elif kind == "all-gather" and parts.get(m.group(1)):
            return arr.nbytes() // parts[m.group(1)]
    return None


def dcn_terms(ins: _Instr, kind: str, slices: int) -> tuple[list, Fraction, int, tuple]:
    """``(payload leaves, factor, group size, groups)`` of the megascale ``send`` ``ins`` of a
    ``kind`` collective over ``slices`` slices: the bytes on the wire are the leaves' times the
    factor (module docstring); no replica groups (it crosses every slice)."""
    arr = sent(ins)
    if kind == "all-gather":
        factor = Fraction(slices - 1)
    elif kind in _TIMES:
        factor = Fraction(_TIMES[kind] * (slices - 1), slices)
    else:  # collective-permute: what it sends
        factor = Fraction(1)
    return (arr.leaves() if arr is not None else []), factor, slices, ()
