"""Peak memory per device of the Flax NNX GPT written as a list of blocks, against the same GPT
stacked and scanned with ``q.nnx.scan``, with and without reshard-after-forward.

    python -m experiments.bench.memory_nnx                          # small preset, 4 and 12 layers
    python -m experiments.bench.memory_nnx --preset tiny --layers 2 --schemes fp32

Layouts: ``scan`` is :class:`experiments.gpt.model_nnx.GPTModel` (one ``nnx.vmap`` stack read
one layer at a time); ``list`` is :class:`~experiments.gpt.model_nnx.GPTListModel` (the blocks
in an ``nnx.List``, a Python loop), trained with the front door's default
``reshard_after_forward=True`` (each block gathered for its call and again in the backward
pass); ``list-held`` is the same with ``reshard_after_forward=False`` (every block's weights
held from the forward to the backward pass). The step is compiled, not run, on simulated CPU
devices, one sequence per device; the peak is that of ``experiments.bench.memory``. Writes
``experiments/results/memory_nnx.json`` and prints a table with each peak over the ``scan``
peak of the same model and scheme.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, cast

from experiments.bench.memory import MB, peak_bytes
from experiments.gpt.devices import simulate_cpu_devices

LAYOUTS = ("scan", "list", "list-held")
SCHEMES = ("fp32", "qsdp-W8G8")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "memory_nnx.json"


def measure(preset: str, n_layers: int, scheme: str, layout: str, n_devices: int) -> dict:
    """Compile the NNX train step of one layout and read its memory (bytes per device)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import qsdp_jax as q
    from experiments.gpt.model import GPTConfig  # imports jax: after simulate_cpu_devices
    from experiments.gpt.model_nnx import GPTListModel, GPTModel, gpt_loss  # imports jax, likewise

    cfg = GPTConfig.from_preset(preset, n_layers=n_layers)
    mesh = q.make_mesh(devices=jax.devices()[:n_devices])
    config = q.QSDPConfig.from_name(scheme)
    model = (GPTModel if layout == "scan" else GPTListModel).init(cfg, 0)
    opt = q.optim.qsdp(optax.adam(1e-3), config)
    t0 = time.perf_counter()
    state = jax.eval_shape(lambda: q.nnx.init_state(model, opt, mesh, config))
    loss = cast(Callable[[nnx.Module, Any], Any], gpt_loss)  # typed for any module; a GPT here
    step = q.nnx.make_train_step(model, loss, opt, mesh, config, reshard_after_forward=layout != "list-held")
    batch = {k: jax.ShapeDtypeStruct((n_devices, cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}
    compiled = step.lower(state, batch).compile()
    return {
        "preset": preset,
        "n_layers": n_layers,
        "scheme": scheme,
        "layout": layout,
        "n_devices": n_devices,
        "peak_bytes": peak_bytes(compiled.memory_analysis()),
        "compile_s": time.perf_counter() - t0,
    }


def table(rows: list[dict]) -> str:
    """One line per row; ``vs scan``: the peak over the ``scan`` row of its model and scheme."""
    scan = {(r["n_layers"], r["scheme"]): r["peak_bytes"] for r in rows if r["layout"] == "scan"}
    head = f"{'preset':<8}{'layers':>7}  {'scheme':<11}{'layout':<11}{'peak MB':>9}{'vs scan':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        base = scan.get((r["n_layers"], r["scheme"]))
        vs = f"{r['peak_bytes'] / base:.2f}x" if base else "-"
        lines.append(
            f"{r['preset']:<8}{r['n_layers']:>7}  {r['scheme']:<11}{r['layout']:<11}{r['peak_bytes'] / MB:>9.2f}{vs:>9}"
        )
    lines += [
        "",
        "MB per device (1e6 B), compiled.memory_analysis(), one sequence per device. scan: blocks in one "
        "nnx.vmap stack, q.nnx.scan;",
        "list: blocks in an nnx.List, Python loop, reshard after forward (the default); list-held: "
        "reshard_after_forward=False.",
    ]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.memory_nnx", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", nargs="+", type=int, default=[4, 12])
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.devices < 1 or any(n < 1 for n in args.layers):
        p.error("--devices and --layers must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    simulate_cpu_devices(args.devices)
    rows = []
    for n_layers in args.layers:
        for scheme in args.schemes:
            for layout in args.layouts:
                r = measure(args.preset, n_layers, scheme, layout, args.devices)
                print(
                    f"  {n_layers} layers {scheme:<10} {layout:<10} peak {r['peak_bytes'] / MB:.2f} MB", file=sys.stderr
                )
                rows.append(r)
    text = table(rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": "python -m experiments.bench.memory_nnx " + " ".join(argv or sys.argv[1:]), "rows": rows}
    args.out.write_text(json.dumps({**record, "table": text}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
