"""Compile seconds of a list-of-blocks Flax NNX model (XLA:CPU, abstract state, 8 simulated
devices): the plain GSPMD step a user of the model writes (``jax.jit`` of the NNX split under
the authors' Explicit mesh, the model's own sharding annotations honoured) beside the QSDP front
door's fp32 and W8G8 steps.

The model is :class:`experiments.gpt.gemma_like.GemmaLike` (blocks in an ``nnx.List``, local and
global attention): ``gemma3-270m`` is Gemma 3 270M's shapes (18 blocks, vocabulary 262144),
``small`` a 3-block toy. One sequence per device. Nothing is allocated: every step is compiled for
``ShapeDtypeStruct`` inputs. Each row is written to the JSON as soon as it is measured, and a
rerun skips the rows already there (``--fresh`` starts over).

    python -m experiments.bench.compile_nnx --model gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.gpt.devices import simulate_cpu_devices

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "compile_nnx.json"
STEPS = ("gspmd", "fp32", "qsdp-W8G8")
MODELS = {"gemma3-270m": dict(seq=1024), "small": dict(seq=64)}


def _model_kwargs(name: str) -> dict:
    from experiments.gpt.gemma_like import GEMMA3_270M  # imports jax: after simulate_cpu_devices

    return dict(GEMMA3_270M) if name == "gemma3-270m" else dict(vocab=512, d=64, heads=4, kv_heads=2)


def _batch(n: int, seq: int):
    import jax
    import jax.numpy as jnp

    shape = (n, seq)
    return {
        "inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
        "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
        "input_mask": jax.ShapeDtypeStruct(shape, jnp.bool_),
    }


def _gspmd_lowered(kwargs: dict, explicit, batch):
    """The plain GSPMD train step of the model, lowered for abstract inputs placed as the
    model's annotations say (the batch on its leading axis)."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from experiments.gpt.gemma_like import GemmaLike, loss_fn  # imports jax, likewise

    with jax.set_mesh(explicit):
        abstract = nnx.eval_shape(lambda: GemmaLike(nnx.Rngs(0), **kwargs))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]
    specs = nnx.get_partition_spec(params)

    def placed(x, spec):
        spec = spec.get_value() if hasattr(spec, "get_value") else spec
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(explicit, spec or P()))

    params = jax.tree.map(placed, params, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt = optax.adam(1e-3)
    opt_state = jax.eval_shape(opt.init, params)
    adam = opt_state[0]._replace(mu=params, nu=params)  # moments placed as their parameters
    count = jax.ShapeDtypeStruct((), adam.count.dtype, sharding=NamedSharding(explicit, P()))
    opt_state = (adam._replace(count=count), *opt_state[1:])
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(explicit, P("fsdp"))) for k, v in batch.items()
    }

    def step(params, opt_state, rest, batch):
        def objective(p):
            return loss_fn(nnx.merge(graphdef, p, rest), batch).value

        loss, grads = jax.value_and_grad(objective)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(explicit):
        return jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, rest, batch)


def _qsdp_lowered(kwargs: dict, explicit, mesh, scheme: str, batch):
    """The front door's step (fp32 or W8G8), lowered for its abstract state."""
    import jax
    import optax
    from flax import nnx

    import qsdp_jax as q
    from experiments.gpt.gemma_like import GemmaLike, loss_fn  # imports jax, likewise

    config = q.QSDPConfig.fp32() if scheme == "fp32" else q.QSDPConfig.qsdp(8, 8)
    with jax.set_mesh(explicit):
        abstract = nnx.eval_shape(lambda: GemmaLike(nnx.Rngs(0), **kwargs))
    opt = q.optim.qsdp(optax.adam(1e-3), config)
    state = q.nnx.abstract_state(abstract, opt, mesh, config)
    step = q.nnx.make_train_step(abstract, loss_fn, opt, mesh, config)
    return step.lower(state, batch)


def measure(model: str, scheme: str, devices: int, target: str | None = None) -> dict:
    """Compile seconds (lowering and compiling, timed apart) and peak bytes of one step, for
    this host's CPU devices or the compile-only devices of ``target`` (a name of
    ``experiments.shelf.targets.TARGETS``: XLA:TPU or XLA:GPU, ahead of time)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import qsdp_jax as q
    from experiments.shelf import targets  # imports jax: after simulate_cpu_devices

    devs = jax.devices()[:devices] if target is None else targets.devices(targets.TARGETS[target])
    kwargs = _model_kwargs(model)
    explicit = Mesh(np.array(devs), ("fsdp",), axis_types=(AxisType.Explicit,))
    batch = _batch(len(devs), MODELS[model]["seq"])
    t0 = time.perf_counter()
    if scheme == "gspmd":
        lowered = _gspmd_lowered(kwargs, explicit, batch)
    else:
        lowered = _qsdp_lowered(kwargs, explicit, q.make_mesh(devices=devs), scheme, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    return {
        "model": model,
        "scheme": scheme,
        "devices": len(devs),
        "target": target or "cpu",
        "compiler": "XLA:CPU" if target is None else f"XLA:{targets.TARGETS[target].kind.upper()}",
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "peak_bytes": int(peak),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | target (compiler) | step | lower s | compile s | compile vs GSPMD | peak MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        where = r.get("target", "cpu")
        key = (r["model"], where, "gspmd")
        base = next((b for b in rows if (b["model"], b.get("target", "cpu"), b["scheme"]) == key), None)
        ratio = f"{r['compile_s'] / base['compile_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['model']} | {where} ({r['compiler']}) | {r['scheme']} | {r['lower_s']:.1f} | "
            f"{r['compile_s']:.1f} | {ratio} | {r['peak_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.compile_nnx", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gemma3-270m")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (without --target)")
    p.add_argument("--target", default=None, help="compile for this target instead (e.g. v5p-8, h100-8)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--fresh", action="store_true", help="start the JSON over instead of resuming it")
    args = p.parse_args(argv)
    if args.devices < 1:
        p.error(f"--devices {args.devices}: must be >= 1")
    from experiments.shelf.targets import TARGETS  # no jax at its top

    if args.target is not None and args.target not in TARGETS:
        p.error(f"--target {args.target!r}: not one of {', '.join(sorted(TARGETS))}")
    simulate_cpu_devices(args.devices)
    record = {"rows": []} if args.fresh or not args.out.exists() else json.loads(args.out.read_text())
    record["command"] = "python -m experiments.bench.compile_nnx " + " ".join(argv or sys.argv[1:])
    where = args.target or "cpu"
    for scheme in args.steps:
        if any(
            (r["model"], r.get("target", "cpu"), r["scheme"]) == (args.model, where, scheme) for r in record["rows"]
        ):
            continue  # measured already (resume)
        row = measure(args.model, scheme, args.devices, args.target)
        print(f"  {args.model} {scheme}: compile {row['compile_s']:.1f} s", file=sys.stderr, flush=True)
        record["rows"].append(row)
        record["table"] = table(record["rows"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
