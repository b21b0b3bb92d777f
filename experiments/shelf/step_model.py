"""The modelled step time of a compiled program on nodes joined by a slower network: one model,
for the compile-for-real-targets benchmark (``experiments.bench.aot``) and its scaling to more
nodes (``experiments.bench.speedup_model``). A model, not a measurement: its inputs travel with
its outputs.

What it reads from the compiled program, per collective (:func:`collective_classes`): its kind,
its replica-group size, whether a group spans nodes (a TPU slice counts as a node), whether the
schedule places a matmul between its start and done (``experiments.shelf.schedule``: "hidden"),
and the bytes one chip sends per step (``comm_report_from_hlo``). What it assumes:

* a collective whose group spans nodes moves its bytes at the inter-node rate per chip (one NIC
  per GPU; a slice's data-center network), one inside a node at the intra-node rate (NVLink,
  ICI): a ring runs at its slowest link;
* hidden collectives run behind compute, so the step is
  ``max(compute, hidden comm) + exposed comm`` (:func:`combine`);
* on more nodes (:func:`node_model` with ``n_to``), each ring collective's bytes per chip scale
  with its group ``g`` as ``(g'-1)/g' / ((g-1)/g)``; a group that spans nodes grows with the node
  count (the whole mesh, or the node axis of a two-level mesh), one inside a node keeps its size;
  the schedule (which collectives are hidden) is the compiled program's. A collective-permute's
  bytes do not depend on its group.
"""

from __future__ import annotations

RING_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def collective_classes(report, sites, n_chips: int, chips_per_node: int) -> list[dict]:
    """The report's collectives summed by (kind, group size, spans nodes, hidden): what
    :func:`node_model` needs, small enough to keep in a result row."""
    hidden = {s.name for s in sites if s.hidden}
    out: dict[tuple, float] = {}
    for c in report.collectives:
        groups = c.replica_groups or (tuple(range(n_chips)),)
        spans = any(len({d // chips_per_node for d in g}) > 1 for g in groups)
        key = (c.kind, max(c.group_size, 1), spans, c.name in hidden)
        out[key] = out.get(key, 0.0) + c.bytes_on_wire
    return [
        {"kind": k, "group": g, "spans_nodes": s, "hidden": h, "bytes": b} for (k, g, s, h), b in sorted(out.items())
    ]


def _ring(g: int) -> float:
    return (g - 1) / g


def scaled_bytes(cls: dict, n_from: int, n_to: int) -> float:
    """One class's bytes per chip on ``n_to`` chips, from its bytes on ``n_from`` (the module
    docstring): a spanning group grows by ``n_to / n_from``, the others keep their size."""
    g = cls["group"]
    if cls["kind"] not in RING_KINDS or g < 2 or n_to == n_from or not cls["spans_nodes"]:
        return cls["bytes"]
    if (g * n_to) % n_from:
        raise ValueError(f"a group of {g} of {n_from} chips does not scale to {n_to} chips")
    return cls["bytes"] * _ring(g * n_to // n_from) / _ring(g)


def combine(compute_s: float, hidden_s: float, exposed_s: float) -> float:
    """The step: hidden communication behind compute, the exposed after it."""
    return max(compute_s, hidden_s) + exposed_s


def node_model(
    classes: list[dict],
    *,
    compute_s: float,
    intra_bytes_per_s: float,
    inter_bytes_per_s: float,
    n_from: int,
    n_to: int | None = None,
    chips_per_node: int,
) -> dict:
    """The modelled step time per chip (seconds) of the program the ``classes`` were read from,
    run on ``n_to`` chips (default: as compiled) with ``chips_per_node`` chips per node; with its
    inputs and parts. ``n_to`` is a whole number of nodes; on one node nothing crosses nodes."""
    n_to = n_from if n_to is None else n_to
    if n_to < chips_per_node or n_to % chips_per_node:
        raise ValueError(f"n_to={n_to} is not a whole number of {chips_per_node}-chip nodes")
    one_node = n_to == chips_per_node
    out = {"n_chips": n_to, "inter_bytes_per_s": inter_bytes_per_s, "intra_bytes_per_s": intra_bytes_per_s}
    out.update(inter_bytes=0.0, intra_bytes=0.0, hidden_comm_s=0.0, exposed_comm_s=0.0, compute_s=compute_s)
    for c in classes:
        b = scaled_bytes(c, n_from, n_to)
        inter = c["spans_nodes"] and not one_node
        out["inter_bytes" if inter else "intra_bytes"] += b
        out["hidden_comm_s" if c["hidden"] else "exposed_comm_s"] += b / (
            inter_bytes_per_s if inter else intra_bytes_per_s
        )
    out["step_s"] = combine(compute_s, out["hidden_comm_s"], out["exposed_comm_s"])
    out["step_no_overlap_s"] = compute_s + out["hidden_comm_s"] + out["exposed_comm_s"]
    return out
