"""The text tables of :class:`qsdp_jax.comm.CommReport` (``report.table()``)."""

from __future__ import annotations

__all__ = ["format_table"]


def format_table(report, per_op: bool = False) -> str:
    """A text table of ``report``'s wire bytes per (kind, dtype), or per instruction with
    ``per_op`` (:meth:`qsdp_jax.comm.CommReport.table`)."""
    total = report.total_bytes
    # Both layouts are rows of text cells; their widths (7 or 6 columns) differ.
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]
    last: tuple[str, ...]
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
            for c in report.collectives
        ]
        last = ("total", "", "", "", "", "", _fmt_num(total))
        left = 3
    else:
        header = ("kind", "dtype", "ops", "calls/step", "wire B/step", "")
        agg: dict[tuple[str, str], list] = {}
        for c in report.collectives:
            a = agg.setdefault((c.kind, c.dtype), [0, 0, 0.0])
            a[0] += 1
            a[1] += c.count
            a[2] += c.bytes_on_wire
        rows = [(k, d, str(n), str(calls), _fmt_num(b), _human(b)) for (k, d), (n, calls, b) in sorted(agg.items())]
        last = ("total", "", "", "", _fmt_num(total), _human(total))
        left = 2
    widths = [max(len(r[i]) for r in (header, *rows, last)) for i in range(len(header))]

    def line(r: tuple[str, ...]) -> str:
        cells = (x.ljust(w) if i < left else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))
        return "  ".join(cells).rstrip()

    sep = "-" * len(line(header))
    out = [line(header), sep, *(line(r) for r in rows), sep, line(last)]
    out += [f"warning: {w}" for w in report.warnings]
    return "\n".join(out)


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def _human(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{_fmt_num(x)} B"
