"""Peak memory per device of the sharded GPT train step, plain GSPMD, fp32 FSDP and QSDP, against the device count.

    python -m experiments.bench.memory                        # all models, 2/4/8 devices
    python -m experiments.bench.memory --models tiny gpt-125m --devices 2 8

For each model (the trainable presets ``tiny``/``small``/``medium`` and the GPT-2 shapes
``gpt-125m``/``gpt-350m``/``gpt-1.3b``), scheme and device count the train step is *compiled,
not run*, from an abstract state (:func:`qsdp_jax.abstract_train_state`) on simulated CPU
devices, with one sequence per device. Scheme ``gspmd`` is the plain ``jax.jit`` +
``NamedSharding`` FSDP step a JAX user would write (:mod:`experiments.shelf.gspmd_fsdp`), the
baseline of column ``vs gspmd``; the others are :func:`qsdp_jax.make_train_step` with
``QSDPConfig.from_name(scheme)``. Suffixes: ``+codes`` (``qsdp-W8G8+codes``) holds the on-grid
weights as their codes (``weight_storage="codes"``: 1 byte per weight at 8 bits instead of 4),
``+mu-bf16`` keeps adam's first moment in bfloat16 (``optax.adam(mu_dtype=jnp.bfloat16)``: 2
bytes less state per parameter), ``+moments-bf16`` both moments, rounded stochastically
(``qsdp_jax.optim.compact_moments``: 4 bytes less), ``+take`` reads the embeddings as rows
(``GPTConfig(embed_lookup="take")``, ``ParamAccess.take``; ``gspmd+take`` is ``gspmd``: on the
plain step it is ``jnp.take`` of the table either way). ``compiled.memory_analysis()`` gives the program's
buffers per device; the peak is ``arguments + outputs - aliased (donated) + temporaries``.

Next to it, the ideal of FSDP: the sharded train state per device (parameters, optimizer state,
replicated small leaves) plus the full fp32 weights of one layer (the one being computed) or
two (plus the next one, prefetched). The rest of the peak is activations, logits and their
gradients (they depend on the batch, not on the sharding) and the gathered layer's gradient
before its reduce-scatter. Writes ``experiments/results/memory.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # the steps qsdp_jax returns are typed Callable; they forward the jit's ``lower``
    from jax.stages import Wrapped

from experiments.gpt.devices import simulate_cpu_devices
from experiments.shelf.schemes import base_optimizer, embed_lookup, mesh_axes, scheme_config, split_scheme

MODELS = ("tiny", "small", "medium", "gpt-125m", "gpt-350m", "gpt-1.3b")
SCHEMES = ("gspmd", "fp32", "qsdp-W8G8")
GSPMD = "gspmd"
DEVICE_COUNTS = (2, 4, 8)
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "memory.json"
MB = 1e6


def peak_bytes(m) -> int:
    """The peak of a ``compiled.memory_analysis()``: arguments + outputs - donated + temporaries."""
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def per_device_bytes(tree) -> int:
    """Bytes one device holds of an abstract pytree of sharded ``ShapeDtypeStruct``s."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def layer_units(layout) -> list[int]:
    """Full fp32 bytes of each unit the step gathers at once: one layer of a stacked group, or
    a whole non-stacked group (the embedding), largest first."""
    units = []
    for g in layout.groups:
        if g.is_sharded:
            units += [g.flat_size * 4] * max(1, g.n_layers if g.stacked else 1)
    return sorted(units, reverse=True)


def gspmd_units(model, params) -> list[int]:
    """:func:`layer_units` of the GSPMD step: the full bytes of one layer of a stacked group
    (its leaves GSPMD shards), or of a whole non-stacked group, largest first."""
    import jax
    import numpy as np

    units = []
    for group, tree in params.items():
        stacked = group in model.stacked_groups
        leaves = [a for a in jax.tree.leaves(tree) if a.sharding.spec != ()]
        size = sum(math.prod(a.shape[1:] if stacked else a.shape) * np.dtype(a.dtype).itemsize for a in leaves)
        if size:
            units += [size] * (model.cfg.n_layers if stacked else 1)
    return sorted(units, reverse=True)


def measure(model_name: str, scheme: str, n_devices: int, batch_per_device: int = 1) -> dict:
    """Compile the train step of ``model_name`` / ``scheme`` (``"gspmd"`` or a
    ``QSDPConfig`` name) on ``n_devices`` devices and read its memory; returns one record
    (bytes per device)."""
    import jax

    devices = jax.devices()
    if n_devices > len(devices):
        raise ValueError(f"{n_devices} devices asked, this process has {len(devices)}")
    return compile_step(model_name, scheme, devices[:n_devices], batch_per_device)[1]


def compile_step(
    model_name: str, scheme: str, devices: list, batch_per_device: int = 1, kernels: str | None = None, hosts: int = 1
):
    """``(compiled, record, state)``: the train step of ``model_name`` / ``scheme`` compiled for
    ``devices`` (this process's, or a real target's compile-only devices), its memory record and
    the abstract state it was compiled for; ``kernels`` overrides the scheme's
    ``QSDPConfig.kernels``; ``hosts``: the nodes the devices are on (a ``+2level`` mesh's outer
    axis)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import qsdp_jax as q
    from experiments.gpt.model import GPT, GPTConfig  # imports jax: after simulate_cpu_devices
    from experiments.shelf import gspmd_fsdp  # imports jax, likewise
    from qsdp_jax import optim

    n_devices = len(devices)
    mesh = q.make_mesh(mesh_axes(scheme, n_devices, hosts), devices=devices)
    model = GPT(GPTConfig.from_preset(model_name, embed_lookup=embed_lookup(scheme)))
    t0 = time.perf_counter()
    batch = {
        k: jax.ShapeDtypeStruct((batch_per_device * n_devices, model.cfg.seq_len), jnp.int32)
        for k in ("inputs", "targets")
    }
    state: tuple[Any, Any] | q.TrainState  # (params, opt_state) for GSPMD, else a TrainState
    base = base_optimizer(scheme, 1e-3)
    if split_scheme(scheme)[0] == GSPMD:
        opt = base
        state = gspmd_fsdp.abstract_state(model, mesh, opt)
        compiled = gspmd_fsdp.make_step(model, opt, mesh).lower(*state, batch).compile()
        units = gspmd_units(model, state[0])
    else:
        cfg = scheme_config(scheme)
        cfg = cfg if kernels is None else dataclasses.replace(cfg, kernels=kernels)
        opt = optim.qsdp(base, cfg)
        state = q.abstract_train_state(model.abstract_params(), opt, mesh, cfg, stacked=model.stacked_groups)
        compiled = cast("Wrapped", q.make_train_step(model.loss, opt, mesh, cfg)).lower(state, batch).compile()
        units = layer_units(state.layout)
    m = compiled.memory_analysis()
    peak = peak_bytes(m)
    state_bytes = per_device_bytes(state)
    record = {
        "model": model_name,
        "scheme": scheme,
        "n_devices": n_devices,
        "n_params": model.count_params(),
        "batch_per_device": batch_per_device,
        "seq_len": model.cfg.seq_len,
        "peak_bytes": peak,
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "state_bytes": state_bytes,
        "largest_unit_bytes": units[0] if units else 0,
        "ideal_1_layer_bytes": state_bytes + sum(units[:1]),
        "ideal_2_layers_bytes": state_bytes + sum(units[:2]),
        "compile_s": time.perf_counter() - t0,
    }
    return compiled, record, state


def table(rows: list[dict]) -> str:
    """One line per (model, scheme, devices); MB = 1e6 bytes per device. ``vs gspmd``: the
    peak over the gspmd row's peak of the same model and device count, where there is one."""
    gspmd = {(r["model"], r["n_devices"]): r["peak_bytes"] for r in rows if r["scheme"] == GSPMD}
    w = max([25] + [len(r["scheme"]) + 1 for r in rows])
    head = (
        f"{'model':<9}{'params':>8} {'scheme':<{w}}{'dev':>4}{'state':>9}{'B/param':>8}{'ideal 1-2 layers':>19}"
        f"{'peak':>9}{'peak/ideal2':>12}{'temp':>9}{'vs gspmd':>10}"
    )
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and (r["model"], r["scheme"]) != last:
            lines.append("")
        last = (r["model"], r["scheme"])
        ideal = f"{r['ideal_1_layer_bytes'] / MB:.1f}-{r['ideal_2_layers_bytes'] / MB:.1f}"
        base = gspmd.get((r["model"], r["n_devices"]))
        vs = f"{r['peak_bytes'] / base:.2f}x" if base else "-"
        per_param = r["state_bytes"] * r["n_devices"] / r["n_params"]  # state bytes per parameter
        lines.append(
            f"{r['model']:<9}{r['n_params'] / 1e6:>7.1f}M {r['scheme']:<{w}}{r['n_devices']:>4}"
            f"{r['state_bytes'] / MB:>9.1f}{per_param:>8.2f}{ideal:>19}{r['peak_bytes'] / MB:>9.1f}"
            f"{r['peak_bytes'] / r['ideal_2_layers_bytes']:>11.2f}x{r['temp_bytes'] / MB:>9.1f}"
            f"{vs:>10}"
        )
    lines += [
        "",
        "MB per device (1e6 B). state: sharded parameters + optimizer state + replicated "
        "small leaves; ideal: state + the full fp32",
        "weights of the largest 1 or 2 gathered "
        "units (a layer, or the embedding); peak: arguments + outputs - donated + temporaries",
        "from compiled.memory_analysis(), one sequence per device; the rest of the peak is activations and logits.",
        "vs gspmd: peak / the peak of the plain "
        "jax.jit + NamedSharding FSDP step (experiments/shelf/gspmd_fsdp.py), same model and devices.",
        "B/param: state bytes per parameter over all devices (adam: 4 weight + 8 moments); "
        "+codes: QSDP's weights held as their codes (weight_storage='codes'); "
        "+mu-bf16: adam's first moment in bfloat16; +moments-bf16: both moments in bfloat16, "
        "rounded stochastically (qsdp_jax.optim.compact_moments); +take: embeddings read as rows "
        "(GPTConfig(embed_lookup='take'), ParamAccess.take), the tied table gathered for the logits alone.",
    ]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    p.add_argument("--devices", nargs="+", type=int, default=list(DEVICE_COUNTS))
    p.add_argument("--batch-per-device", type=int, default=1)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if any(n < 1 for n in args.devices) or args.batch_per_device < 1:
        p.error("--devices and --batch-per-device must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    simulate_cpu_devices(max(args.devices))  # compile only: the program's memory, per device
    rows = []
    for model in args.models:
        for scheme in args.schemes:
            for n in sorted(args.devices):
                r = measure(model, scheme, n, args.batch_per_device)
                print(
                    f"  {model:<9} {scheme:<10} {n} devices: peak {r['peak_bytes'] / MB:.1f} MB "
                    f"({r['compile_s']:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                rows.append(r)
    text = table(rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "python -m experiments.bench.memory " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
        "table": text,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
