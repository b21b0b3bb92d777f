"""Sphinx extension: render the results pages' tables from the committed JSON, at build time.

Each table is made by the benchmark's own report function from the JSON file it wrote under
``experiments/results/``, so the docs always show what the committed results hold (no copied
numbers). Output: ``docs/results/generated/<name>.md`` (not committed), which the results pages
pull in with ``{include}``. A missing or unreadable results file fails the build, naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
OUT = ROOT / "docs" / "results" / "generated"


def _comm(doc: dict) -> str:
    from experiments.bench.comm import table

    return table(doc["results"])


def _memory(doc: dict) -> str:
    from experiments.bench.memory import table

    return table(doc["rows"])


def _memory_nnx(doc: dict) -> str:
    from experiments.bench.memory_nnx import table

    return table(doc["rows"])


def _overhead(doc: dict) -> str:
    from experiments.bench.overhead import table

    return table(doc)


def _kernels(doc: dict) -> str:
    from experiments.bench.kernels import table

    return table(doc)


def _tpu_kernels(doc: dict) -> str:
    from experiments.bench.tpu_kernels import table

    return table(doc["rows"])


def _aot(doc: dict) -> str:
    from experiments.bench.aot import nodes_table, overlap_table, table

    return table(doc["rows"]) + "\n\n" + overlap_table(doc["rows"]) + "\n\n" + nodes_table(doc["rows"])


def _network(doc: dict) -> str:
    from experiments.shelf.network_results import format_table

    return format_table(doc)


def _twolevel(doc: dict) -> str:
    from experiments.bench.twolevel import axis_table, step_table

    return (
        step_table(doc, doc["bytes_by_axis"], doc["devices_per_process"])
        + "\n\n"
        + "wire bytes per device per step, by the mesh axes each collective spans:\n"
        + axis_table(doc["bytes_by_axis"])
    )


def _speedup(doc: dict) -> str:
    from experiments.bench.speedup_model import check_table, table

    return table(doc["predictions"], nodes=(2, 8, 64)) + "\n\n" + check_table(doc["network_check"])


def _grid_walk(doc: dict) -> str:
    from experiments.convergence.grid_walk import table

    return table(doc["result"])


# generated page name -> (results file, renderer)
TABLES: dict[str, tuple[str, Callable[[dict], str]]] = {
    "comm_bytes": ("comm_bytes.json", _comm),
    "memory": ("memory.json", _memory),
    "memory_nnx": ("memory_nnx.json", _memory_nnx),
    "overhead": ("overhead.json", _overhead),
    "kernels_cpu": ("kernels_cpu.json", _kernels),
    "kernels_h200": ("kernels_h200.json", _kernels),
    "tpu_kernels": ("tpu_kernels.json", _tpu_kernels),
    "aot": ("aot.json", _aot),
    "network": ("network.json", _network),
    "network_twolevel": ("network_twolevel.json", _twolevel),
    "speedup_model": ("speedup_model.json", _speedup),
    "grid_walk": ("grid_walk.json", _grid_walk),
}


def _as_markdown(text: str, source: str, command: str | None) -> str:
    """Markdown tables pass through; fixed-width text tables go in a code block."""
    body = text.strip("\n")
    if not body.lstrip().startswith("|"):
        body = f"```text\n{body}\n```"
    made = f"`{command}`, " if command else ""
    return f"{body}\n\n*Rendered from `experiments/results/{source}` ({made}committed JSON).*\n"


def render_all(out: Path = OUT) -> list[Path]:
    """Write every generated table; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (source, render) in TABLES.items():
        path = RESULTS / source
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise RuntimeError(f"results table {name!r}: cannot read {path}: {e}") from e
        target = out / f"{name}.md"
        target.write_text(_as_markdown(render(doc), source, doc.get("command")))
        written.append(target)
    return written


def _on_builder_inited(app) -> None:
    render_all()


def setup(app):
    app.connect("builder-inited", _on_builder_inited)
    return {"version": "1", "parallel_read_safe": True}
