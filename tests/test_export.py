"""The sharded train step lowers for hardware this machine does not have (``jax.export`` with
``platforms=["tpu"]`` / ``["cuda"]``), on 1-D and 2-D meshes, and the exported module carries
the packed uint8 collectives (on the right mesh axes for the two-level mesh)."""

import inspect
import re

import jax
import numpy as np
import optax
import pytest

import qsdp_jax as q
import toymodel
from qsdp_jax import optim

SMALL = dict(bucket_size=64, min_shard_size=128)
WHOLE = "[[0, 1, 2, 3, 4, 5, 6, 7]]"
INSIDE = "[[0, 1, 2, 3], [4, 5, 6, 7]]"  # "local" on a (2, 4) mesh; "fsdp" of (replica, fsdp)
ACROSS = "[[0, 4], [1, 5], [2, 6], [3, 7]]"  # "node" / "replica"

CASES = {
    "1d-qsdp": ("fsdp", lambda: q.QSDPConfig.qsdp(8, 8, **SMALL)),
    "1d-fp32": ("fsdp", lambda: q.QSDPConfig.fp32(**SMALL)),
    "hier-qsdp": (
        {"node": 2, "local": 4},
        lambda: q.QSDPConfig.qsdp(8, 8, inter_grad_bits=4, axis_name="local", node_axis="node", **SMALL),
    ),
    "hier-fp32": ({"node": 2, "local": 4}, lambda: q.QSDPConfig.fp32(axis_name="local", node_axis="node", **SMALL)),
    "hybrid-qsdp": (
        {"replica": 2, "fsdp": 4},
        lambda: q.QSDPConfig.qsdp(8, 8, inter_grad_bits=4, replica_axis="replica", **SMALL),
    ),
    "1d-codes": ("fsdp", lambda: q.QSDPConfig.qsdp(4, 4, weight_storage="codes", **SMALL)),
    "hier-codes": (
        {"node": 2, "local": 4},
        lambda: q.QSDPConfig.qsdp(8, 8, axis_name="local", node_axis="node", weight_storage="codes", **SMALL),
    ),
}


def _export(case: str, platform: str):
    axes, make_config = CASES[case]
    mesh, config = q.make_mesh(axes), make_config()
    opt = optim.qsdp(optax.adam(1e-2), config)
    state = q.abstract_train_state(toymodel.init(0), opt, mesh, config, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss, opt, mesh, config)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), toymodel.batch(0))
    # jax.export takes a jax.stages.Wrapped from jax 0.11, a protocol Python 3.12 checks
    # statically (a method reached through __getattr__ does not count)
    assert all(inspect.getattr_static(step, m, None) is not None for m in ("__call__", "trace", "lower"))
    exported = jax.export.export(step, platforms=[platform])(state, batch)
    assert exported.platforms == (platform,) and exported.nr_devices == 8
    return mesh, exported.mlir_module()


def _axes_groups(mesh, axes: list[str]) -> str:
    """The device groups of ``mesh`` that vary along ``axes``, written as ``dense<...>`` is."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    rest = [i for i, name in enumerate(mesh.axis_names) if name not in axes]
    inner = [mesh.axis_names.index(name) for name in axes]
    groups = ids.transpose(rest + inner).reshape(-1, int(np.prod([ids.shape[i] for i in inner])))
    return str(groups.tolist())


def u8_collectives(mesh, module: str, platform: str = "cuda") -> set[tuple[str, str]]:
    """``(op, replica groups)`` of every all_gather / all_to_all with a ui8 operand or result
    (on ``platform="tpu"`` the ui8 payloads go as ui32 words: ``tpu_wire``). jax <= 0.10 writes the groups as ``dense<[[...]]>``, jax 0.11
    as the mesh axes they span (``replica_group_mesh_axes<mesh = @m, axes = [#stablehlo.axis_ref<name = "x">]>``)."""
    found = set()
    for line in module.splitlines():
        m = re.search(r'"stablehlo\.(all_gather|all_to_all)"', line)
        if m and ("ui32>" if platform == "tpu" else "ui8>") in line:
            dense = re.search(r"replica_groups = dense<(\[\[.*?\]\])>", line)
            axes = re.search(r"replica_groups = #stablehlo\.replica_group_mesh_axes<[^>]*axes = \[(.*?)\]>", line)
            if dense:
                groups = dense.group(1)
            elif axes:
                groups = _axes_groups(mesh, re.findall(r'name = "(\w+)"', axes.group(1)))
            else:
                groups = "?"
            found.add((m.group(1), groups))
    return found


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("case", ["1d-qsdp", "hier-qsdp", "hybrid-qsdp", "hier-fp32", "1d-codes", "hier-codes"])
def test_train_step_exports_with_packed_collectives(case, platform):
    got = u8_collectives(*_export(case, platform), platform=platform)
    if case in ("1d-qsdp", "1d-codes"):
        assert got == {("all_gather", WHOLE), ("all_to_all", WHOLE)}
    elif case == "hier-codes":  # the stored codes cross nodes, then are forwarded inside
        assert got == {(op, g) for op in ("all_gather", "all_to_all") for g in (INSIDE, ACROSS)}
    elif case == "hier-qsdp":  # two stages, each on its own axis, for weights and gradients
        assert got == {(op, g) for op in ("all_gather", "all_to_all") for g in (INSIDE, ACROSS)}
    elif case == "hybrid-qsdp":  # gather inside the group; gradients quantized across too
        assert got == {("all_gather", INSIDE), ("all_to_all", INSIDE), ("all_to_all", ACROSS), ("all_gather", ACROSS)}
    else:  # the fp32 baseline sends no packed bytes: the check above can fail
        assert got == set()
