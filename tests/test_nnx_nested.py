"""Layer stacks nested below the top level of an NNX module (``self.trunk.layers``): found by the
front door, gathered one layer at a time by the drop-in scan, trained as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qsdp_jax as q
from qsdp_jax import nnx as qnnx
from qsdp_jax._src.nnx.tree import describe, group_params
from qsdp_jax import comm
from tests.test_nnx import Block, _reference, _sharded, _stacked_batch, block_stack, check_scanned_stack, mse, run_stack

CFG = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=128)


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


class Trunk(nnx.Module):
    """A stack of Blocks (nnx.split_rngs + nnx.vmap) and a final norm, one level down."""

    def __init__(self, rngs, d, n_layers, scan):
        self.layers = block_stack(rngs, d, n_layers)
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.scan = scan

    def __call__(self, x):
        return self.norm(run_stack(self.scan, x, self.layers))


class Nested(nnx.Module):
    def __init__(self, rngs, d=32, n_layers=3, scan=qnnx.scan):
        self.inp = nnx.Linear(4, d, rngs=rngs)
        self.trunk = Trunk(rngs, d, n_layers, scan)
        self.out = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.trunk(self.inp(x)))[:, 0]


class RawStack(nnx.Module):
    """Two raw nnx.Param tensors with a shared leading axis: no flax layer to vouch for a stack."""

    def __init__(self, rngs):
        self.inner = nnx.Module()
        self.inner.w = nnx.Param(jax.random.normal(rngs.params(), (3, 8, 8)))
        self.inner.v = nnx.Param(jax.random.normal(rngs.params(), (3, 8, 4)))
        self.bias = nnx.Param(jnp.zeros(4))


def _groups(model, stacked=None):
    return {g.name: (g.stacked, g.n_layers) for g in describe(model, stacked).groups}


def test_a_stack_one_and_two_levels_down_is_its_own_group():
    assert _groups(Nested(nnx.Rngs(0))) == {
        "inp": (False, 0),
        "out": (False, 0),
        "trunk": (False, 0),  # the norm: what the trunk holds outside its stack
        "trunk/layers": (True, 3),
    }
    model = Nested(nnx.Rngs(0))
    model.enc = nnx.Module()
    model.enc.proj = nnx.Linear(32, 32, rngs=nnx.Rngs(1))
    model.enc.body = Trunk(nnx.Rngs(1), 32, 2, qnnx.scan)
    groups = _groups(model)
    assert groups["enc/body/layers"] == (True, 2) and groups["enc"] == (False, 0) and "enc/body" not in groups
    params = group_params(model, describe(model))
    assert set(params["trunk"]) == {"norm"}  # the nested stack's parameters are not in it twice
    assert set(params["enc"]) == {"proj", "body"} and set(params["enc"]["body"]) == {"norm"}
    assert params["trunk/layers"]["lin"]["kernel"].shape == (3, 32, 32)
    model.enc.proj = model.enc.body.norm = None  # a group holding only a stack: the top-level rule
    assert _groups(model)["enc"] == (True, 2) and "enc/body/layers" not in _groups(model)


def test_raw_parameter_stacks_are_found_only_when_named():
    model = RawStack(nnx.Rngs(0))
    model.holder = nnx.Module()
    model.holder.stack = model.inner
    model.holder.scale = nnx.Param(jnp.ones(8))  # so the holder is no stack itself
    del model.inner
    assert _groups(model) == {"bias": (False, 0), "holder": (False, 0)}
    want = {"bias": (False, 0), "holder": (False, 0), "holder/stack": (True, 3)}
    assert _groups(model, ["holder/stack"]) == want
    with pytest.raises(ValueError, match=r"\['holder/nope'\] are not groups or sub-modules"):
        describe(model, ["holder/nope"])
    with pytest.raises(ValueError, match=r"'bias' is named in stacked="):
        describe(model, ["bias"])


def test_nested_stack_matches_one_device_and_gathers_per_layer(mesh):
    check_scanned_stack(mesh, Nested, "trunk/layers")


def test_nested_stack_read_with_plain_nnx_scan_is_gathered_whole_and_says_so(mesh):
    batches = [_stacked_batch(0)]
    model = Nested(nnx.Rngs(0), scan=nnx.scan)
    with pytest.warns(UserWarning, match=r"\['trunk/layers'\] are gathered whole"):
        losses, state, step, _ = _sharded(model, mse, batches, mesh, CFG, 1e-2)
    np.testing.assert_allclose(losses, _reference(Nested(nnx.Rngs(0)), mse, batches, 1e-2), rtol=1e-5)
    assert "whole stack:" in step.summary(state, batches[0])


class ListTrunk(nnx.Module):
    """Blocks in an nnx.List and a final norm, one level down (``model.trunk.layers``)."""

    def __init__(self, rngs, d, n_layers):
        self.layers = nnx.List([Block(d, rngs) for _ in range(n_layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, x):
        for block in self.layers:
            x = block(x)
        return self.norm(x)


class NestedList(nnx.Module):
    def __init__(self, rngs, d=64, n_layers=3):
        self.inp = nnx.Linear(4, d, rngs=rngs)
        self.trunk = ListTrunk(rngs, d, n_layers)
        self.out = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.trunk(self.inp(x)))[:, 0]


class TopList(nnx.Module):
    """The same blocks as NestedList, in a top-level nnx.List (same parameters, same order)."""

    def __init__(self, rngs, d=64, n_layers=3):
        self.inp = nnx.Linear(4, d, rngs=rngs)
        self.layers = nnx.List([Block(d, rngs) for _ in range(n_layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.out = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.out(self.norm(x))[:, 0]


def test_a_nested_list_of_blocks_is_gathered_per_block_like_a_top_level_list(mesh):
    """``model.trunk.layers`` as an nnx.List was one group, gathered whole for every block's
    call; now each entry is a group, as in a top-level list: the same gathers (payload by
    payload), a peak within 10% of the top-level list's (XLA:CPU), and one device's losses."""
    groups = _groups(NestedList(nnx.Rngs(0)))
    assert groups == {"inp": (False, 0), "out": (False, 0), "trunk": (False, 0)} | {
        f"trunk/layers/{i}": (False, 0) for i in range(3)
    }
    batches = [_stacked_batch(i) for i in range(2)]
    runs = {}
    for make in (NestedList, TopList):
        losses, state, _, compiled = _sharded(make(nnx.Rngs(0)), mse, batches, mesh, CFG, 1e-2)
        np.testing.assert_allclose(losses, _reference(make(nnx.Rngs(0)), mse, batches, 1e-2), rtol=1e-5)
        gathers = sorted(
            (c.payload_bytes, c.count) for c in comm.comm_report(compiled).collectives if c.kind == "all-gather"
        )
        runs[make.__name__] = (gathers, compiled.memory_analysis().temp_size_in_bytes)
    assert runs["NestedList"][0] == runs["TopList"][0]
    nested, top = runs["NestedList"][1], runs["TopList"][1]
    assert nested <= 1.10 * top, (nested, top)
