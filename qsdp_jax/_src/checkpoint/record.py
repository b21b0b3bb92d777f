"""What defines a checkpoint: the JSON record stored beside the arrays, and the comparison
that refuses a checkpoint made for another config, model or run (naming the field)."""

from __future__ import annotations

import dataclasses
import json

from jax.sharding import Mesh

from qsdp_jax.config import QSDPConfig, check_config
from qsdp_jax.layout import ParamLayout
from qsdp_jax.version import __version__

FORMAT = 2


class CheckpointMismatch(ValueError):
    """The checkpoint was made for another config, model or run; the message names the field."""


def library_version() -> str:
    """``qsdp_jax.__version__`` (written once, in ``qsdp_jax/version.py``; pyproject.toml reads it
    too); a source checkout that was never installed knows it as well."""
    return __version__


# Keyed by object: looked up with whatever a record's "format" holds (None when it has none).
FORMAT_NAMES: dict[object, str] = {1: "flat per-layer buffers (qsdp_jax before the per-parameter layout)"}


def describe_layout(layout: ParamLayout) -> dict:
    """The device-count-independent part of a layout (the model's shape as the state sees it)."""
    return {
        "bucket": layout.bucket,
        "groups": {
            g.name: {
                "stacked": g.stacked,
                "n_layers": g.n_layers,
                "treedef": str(g.treedef),
                "leaves": [[x.path, list(x.shape), x.dtype] for x in g.leaves],
            }
            for g in layout.groups
        },
    }


def describe_grids(layout: ParamLayout, config: QSDPConfig) -> dict:
    """``{leaf path: geometry}`` of every weight grid (``"qsdp"`` mode): ``"row-major"`` where
    the buckets do not depend on the device count, else the split and the shard count."""
    if config.weight_mode != "qsdp":
        return {}
    out = {}
    for (g, x), bits in zip(layout.leaves(), layout.weight_bits(config)):
        if bits is None:
            continue
        if x.dim == 0 and x.local_size % layout.bucket == 0:
            out[x.path] = "row-major"
        else:
            out[x.path] = f"dim {x.dim} over {layout.num_shards} shards, {x.buckets} buckets each"
    return out


def _config_record(config: QSDPConfig) -> dict:
    """The config as stored; ``bit_policy`` only when set and ``weight_storage`` only when not
    ``"float32"``, so that checkpoints made before those fields existed compare equal to a config
    with their defaults (and another value is a named mismatch)."""
    record = dataclasses.asdict(config)
    if not config.bit_policy:
        record.pop("bit_policy")
    else:
        record["bit_policy"] = [list(r) for r in config.bit_policy]
    if config.weight_storage == "float32":
        record.pop("weight_storage")
    return record


def describe(state, config: QSDPConfig, mesh: Mesh, identity: dict | None = None) -> dict:
    """What must match for a checkpoint of ``state`` to load into a run (see :func:`check_match`)."""
    check_config(config)
    return {
        "format": FORMAT,
        "config": _config_record(config),
        "layout": describe_layout(state.layout),
        "grids": describe_grids(state.layout, config),
        "identity": jsonable(identity or {}),
    }


# Where the state lives, not what it is: a checkpoint loads onto another mesh shape (1-D fsdp,
# hierarchical node x local) with other axis names.
PLACEMENT_FIELDS = ("axis_name", "node_axis", "replica_axis")


def comparable(record: dict) -> dict:
    """``record`` (from :func:`describe`) without the config's mesh-placement fields."""
    config = {k: v for k, v in (record.get("config") or {}).items() if k not in PLACEMENT_FIELDS}
    return {**record, "config": config}


def check_match(saved: dict, wanted: dict, where: str = "checkpoint") -> None:
    """Raise :class:`CheckpointMismatch` naming the first field where ``saved`` and ``wanted``
    differ (dotted path, both values)."""
    diff = _first_difference(saved, wanted, "")
    if diff is not None:
        field, a, b = diff
        raise CheckpointMismatch(
            f"{where} does not match this run: {field} is {a!r} in the checkpoint but {b!r} here; "
            "resume with the same settings, or start a fresh run in another directory"
        )


def _first_difference(a, b, prefix: str):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            name = f"{prefix}.{k}" if prefix else str(k)
            if k not in a:
                return name, "<absent>", b[k]
            if k not in b:
                return name, a[k], "<absent>"
            d = _first_difference(a[k], b[k], name)
            if d is not None:
                return d
        return None
    return None if a == b else (prefix, a, b)


def check_format(meta: dict, where: str) -> None:
    if meta.get("format") != FORMAT:
        old = FORMAT_NAMES.get(meta.get("format"), f"format {meta.get('format')!r}")
        raise CheckpointMismatch(
            f"{where} was written in {old}; this version of qsdp_jax reads format {FORMAT} "
            "(per-parameter leaves): restore it with the version that wrote it, or start afresh"
        )


def moved_grids(saved: dict, wanted: dict) -> list[str]:
    """The leaves whose QSDP grid has other buckets here (see the module docstring)."""
    return sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))


def refuse_grids(saved: dict, wanted: dict, moved: list[str], where: str) -> None:
    k = moved[0]
    raise CheckpointMismatch(
        f"{where}: the weight grid of {len(moved)} leaves has other buckets on this mesh "
        f"({k}: {saved.get(k, 'no grid')!r} in the checkpoint, {wanted.get(k, 'no grid')!r} "
        "here): a grid restores exactly only where a leaf's shard is whole buckets of its "
        "row-major order on both meshes. Restore on the checkpoint's mesh shape, or pass "
        "regrid=True to re-project those weights onto this mesh's grid (round to nearest)"
    )


def jsonable(x):
    return json.loads(json.dumps(x, default=str))
