"""Bytes on the wire per device per step of the compiled GPT train step, by scheme, and the
analytic formula they are checked against. Shared by ``experiments.bench.comm`` (the table and
``comm_bytes.json``) and ``experiments.convergence.frontier_bits``.

:func:`measure` *compiles, does not run*, the train step from an abstract state
(:func:`qsdp_jax.abstract_train_state`) and an abstract batch, so nothing of model size is
allocated; :func:`qsdp_jax.comm.comm_report` reads the optimized HLO and gives the wire bytes one
device sends per step (ring model, ``(N-1)/N`` of the payload), split by collective kind and
element type.

Next to each HLO count stands the analytic value (:func:`formula_bytes`): over the gathers and
scatters of one step, ``elements * bits/8 + 8 bytes per bucket`` (a float32 scale and offset)
for a quantized collective, ``elements * 4`` (fp32) or ``* 2`` (bf16) otherwise, times
``(N-1)/N``. ``elements`` is the padded flat buffer of a group (per layer, times the layers).
Per step the GPT step does (see :func:`gpt_collective_counts`):

* ``blocks``: two gathers per layer (the forward, and the re-gather of the rematerialised
  layer in the backward pass) and one reduce-scatter per layer;
* ``embed``: one gather and one reduce-scatter (a tied embedding is gathered once and used
  at both ends; its two cotangents are summed before the one reduce-scatter);
* ``head``: one gather and one reduce-scatter if it has sharded leaves (untied output layer).

The small replicated leaves (biases, norm scales) are averaged with an all-reduce that the
formula leaves out. A scheme name ending in ``+take`` (``qsdp-W8G8+take``) builds the GPT with
``embed_lookup="take"``: its embedding rows travel in float32 outside the formula (the tied
table is still gathered once and reduce-scattered once, for the logits).

Imports no jax at the top: :func:`measure` needs jax with enough devices, so the caller sets
the device count (``experiments.gpt.devices.simulate_cpu_devices``) first.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Sequence, cast

from experiments.shelf.schemes import embed_lookup, split_scheme

if TYPE_CHECKING:  # the steps qsdp_jax returns are typed Callable; they forward the jit's ``lower``
    from jax.stages import Wrapped

DEFAULT_SCHEMES = ("fp32", "bf16", "qsdp-W8G8", "qsdp-W6G6", "qsdp-W4G4", "qsdp-W4G8", "qsdp-W2G4")
KINDS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
#: Kinds that carry the gathers and the (quantized or bf16: all-to-all) reduce-scatters.
GATHER_SCATTER_KINDS = ("all-gather", "all-to-all", "reduce-scatter")


# ----------------------------------------------------------------------------------------------
# Schemes and the analytic formula (pure)
# ----------------------------------------------------------------------------------------------


def scheme_config(name: str, bucket: int = 1024):
    """The QSDPConfig of a scheme name (``fp32``, ``bf16``, ``qsdp-W8G8``, ``W2G4``..., with
    ``+take`` or not: :mod:`experiments.shelf.schemes`).

    Raises:
      ValueError: an unknown name, or a suffix other than ``+take`` (the others change the
        state, not the bytes on the wire).
    """
    from qsdp_jax.config import QSDPConfig

    base, options = split_scheme(name)
    if options - {"take"}:
        raise ValueError(
            f"scheme {name!r}: the bytes do not depend on {sorted(options - {'take'})}; only +take counts here"
        )
    return QSDPConfig.from_name(base, bucket_size=bucket)


def wire_bytes_per_element(bits: int | None, fp_dtype: str, bucket: int, stats_dtype: str = "float32") -> float:
    """Payload bytes per element of one gathered / scattered buffer.

    Quantized: ``bits/8`` plus a scale and offset per bucket (8 bytes as float32, 4 with
    ``stats_dtype="bfloat16"``); otherwise 4 (float32) or 2 (bfloat16).
    """
    if bits is None:
        return {"float32": 4.0, "bfloat16": 2.0}[fp_dtype]
    return bits / 8 + (8 if stats_dtype == "float32" else 4) / bucket


def gpt_collective_counts() -> tuple[dict[str, int], dict[str, int]]:
    """(gathers, scatters) per step of each GPT group, per layer for the stacked ``blocks``.

    See the module docstring: blocks 2 gathers (forward + remat) and 1 scatter per layer; embed
    and head 1 and 1 (tied or not: a tied embedding is gathered once).
    """
    gathers = {"blocks": 2, "embed": 1, "head": 1}
    scatters = {"blocks": 1, "embed": 1, "head": 1}
    return gathers, scatters


def formula_bytes(layout, config, n_devices: int, gathers: dict, scatters: dict) -> dict[str, float]:
    """Analytic wire bytes per device per step over the gathers and scatters.

    ``sum over groups of count * elements * bytes_per_element * (N-1)/N``, with ``elements``
    the padded flat buffer (times the layers of a stacked group) and ``count`` from
    ``gathers`` / ``scatters`` (per layer for a stacked group).
    """
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    ring = (n_devices - 1) / n_devices
    sd = config.stats_dtype
    w = wire_bytes_per_element(config.weight_bits, config.fp_comm_dtype, config.bucket_size, sd)
    g = wire_bytes_per_element(config.grad_bits, config.fp_comm_dtype, config.bucket_size, sd)
    gather = scatter = 0.0
    for grp in layout.groups:
        if not grp.is_sharded:
            continue
        elements = grp.flat_size * (grp.n_layers if grp.stacked else 1)
        gather += gathers.get(grp.name, 0) * elements * w * ring
        scatter += scatters.get(grp.name, 0) * elements * g * ring
    return {"gather": gather, "scatter": scatter, "total": gather + scatter}


# ----------------------------------------------------------------------------------------------
# Measurement (compiles; needs jax with enough devices)
# ----------------------------------------------------------------------------------------------
def measure(
    preset: str,
    schemes: Sequence[Any] = DEFAULT_SCHEMES,  # names, or QSDPConfig objects (keyed by .name)
    *,
    n_devices: int | None = None,
    bucket: int = 1024,
    batch_size: int = 16,
    verbose: bool = False,
) -> dict[str, Any]:
    """Compile the GPT train step of ``preset`` for each scheme and count its wire bytes.

    Returns ``{"preset", "model", "n_params", "n_sharded_elements", "n_layers", "n_devices",
    "bucket_size", "batch", "schemes": {name: record}}``; a record holds ``total_bytes``,
    ``by_kind``, ``by_kind_dtype``, ``hlo_gather_scatter_bytes``, ``formula_bytes`` (gather /
    scatter / total), ``formula_rel_diff``, ``ratio_vs_fp32`` / ``ratio_vs_bf16`` (when those
    schemes are in the list) and ``compile_s``.
    """
    import jax  # the caller has set the device count
    import jax.numpy as jnp
    import optax

    import qsdp_jax as q
    from experiments.gpt.model import GPT, GPTConfig  # imports jax, likewise
    from qsdp_jax import comm, optim

    names = [s.name if isinstance(s, q.QSDPConfig) else s for s in schemes]
    twice = sorted({s for s in names if names.count(s) > 1})
    if twice:  # records are keyed by name: e.g. configs differing only in bucket_size
        raise ValueError(f"schemes {twice} are named twice; measure them in separate calls")
    devices = jax.devices()
    n = len(devices) if n_devices is None else int(n_devices)
    if n < 1 or n > len(devices):
        raise ValueError(f"n_devices={n_devices}: this process has {len(devices)} devices")
    if batch_size % n:
        raise ValueError(f"batch_size={batch_size} does not divide over {n} devices")
    mesh = q.make_mesh(devices=devices[:n])
    model = GPT(GPTConfig.from_preset(preset))
    params = model.abstract_params()
    seq = model.cfg.seq_len
    batch = {k: jax.ShapeDtypeStruct((batch_size, seq), jnp.int32) for k in ("inputs", "targets")}
    gathers, scatters = gpt_collective_counts()

    out: dict[str, Any] = {
        "preset": preset,
        "model": dataclasses.asdict(model.cfg),
        "n_params": model.count_params(),
        "n_layers": model.cfg.n_layers,
        "flops_per_token": model.flops_per_token(),
        "n_devices": n,
        "bucket_size": bucket,
        "batch": [batch_size, seq],
        "formula_counts": {"gathers": gathers, "scatters": scatters},
        "schemes": {},
    }
    for name, scheme in zip(names, schemes):
        cfg = scheme if isinstance(scheme, q.QSDPConfig) else scheme_config(scheme, bucket)
        lookup = embed_lookup(scheme) if isinstance(scheme, str) else "gather"
        model = GPT(dataclasses.replace(model.cfg, embed_lookup=lookup))
        t0 = time.perf_counter()
        opt = optim.qsdp(optax.adam(1e-3), cfg)
        state = q.abstract_train_state(params, opt, mesh, cfg, stacked=model.stacked_groups)
        step = q.make_train_step(model.loss, opt, mesh, cfg)
        report = comm.comm_report(cast("Wrapped", step).lower(state, batch).compile())
        dt = time.perf_counter() - t0
        by_kind = {k: report.by_kind().get(k, 0.0) for k in KINDS}
        hlo_gs = sum(by_kind[k] for k in GATHER_SCATTER_KINDS)
        f = formula_bytes(state.layout, cfg, n, gathers, scatters)
        out["n_sharded_elements"] = sum(g.flat_size * (g.n_layers if g.stacked else 1) for g in state.layout.groups)
        out["schemes"][name] = {
            "config": cfg.name,
            "weight_bits": cfg.weight_bits,
            "grad_bits": cfg.grad_bits,
            "fp_comm_dtype": cfg.fp_comm_dtype,
            "total_bytes": report.total_bytes,
            "by_kind": by_kind,
            "by_kind_dtype": {f"{k}/{d}": v for (k, d), v in sorted(report.by_kind_dtype().items())},
            "n_collective_calls": sum(c.count for c in report.collectives),
            "hlo_gather_scatter_bytes": hlo_gs,
            "formula_bytes": f,
            "formula_rel_diff": (hlo_gs - f["total"]) / f["total"] if f["total"] else 0.0,
            "warnings": list(report.warnings),
            "compile_s": dt,
        }
        if verbose:
            print(f"  {preset:<8} {name:<10} {report.total_bytes / 1e6:10.3f} MB  ({dt:.1f} s)", flush=True)
    for key, ref in (("ratio_vs_fp32", "fp32"), ("ratio_vs_bf16", "bf16")):
        base = out["schemes"].get(ref)
        for rec in out["schemes"].values():
            rec[key] = base["total_bytes"] / rec["total_bytes"] if base else None
    return out
