"""Models that carry sharding annotations train in the FSDP step under one rule: flax layers'
out_sharding arguments are ignored, parameter partitioning metadata stays metadata, and an
annotation the model makes itself is an error naming the rule (not JAX's NotImplementedError)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import qsdp_jax as q
from qsdp_jax import nnx as qnnx

CFG = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=64)


class Annotated(nnx.Module):
    """Partitioned parameters and out_sharding on every call, as the Flax Gemma example's
    ShardingConfig.fsdp_tp_sharding() gives them (here on the 1-D fsdp mesh)."""

    def __init__(self, rngs, spec=P("fsdp", None, None), constrain=False):
        part = nnx.with_partitioning
        self.emb = nnx.Embed(32, 16, embedding_init=part(nnx.initializers.normal(), ("fsdp", None)), rngs=rngs)
        self.lin = nnx.Linear(16, 16, kernel_init=part(nnx.initializers.lecun_normal(), (None, "fsdp")), rngs=rngs)
        self.spec, self.constrain = spec, constrain

    def __call__(self, tokens):
        x = self.emb(tokens, out_sharding=self.spec)
        x = jax.nn.gelu(self.lin(x, out_sharding=self.spec))
        if self.constrain:
            x = jax.lax.with_sharding_constraint(x, self.spec)
        return self.emb.attend(x, out_sharding=self.spec)


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["t"][:, :-1]), batch["t"][:, 1:]).mean()


def _batch(i):
    return {"t": jax.random.randint(jax.random.key(i), (16, 9), 0, 32)}


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def test_annotated_model_trains_as_the_plain_gspmd_step_with_its_annotations(mesh):
    """The model is made as its authors make it, under an Explicit mesh (``jax.make_mesh``'s
    default, which flax's out_sharding needs); the reference is the plain GSPMD step on it."""
    explicit = jax.make_mesh((8,), ("fsdp",))
    with jax.set_mesh(explicit):
        model, ref = Annotated(nnx.Rngs(0)), Annotated(nnx.Rngs(0))
    opt = q.optim.qsdp(optax.adam(1e-2), CFG)
    state = qnnx.init_state(model, opt, mesh, CFG)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, CFG)
    with jax.set_mesh(explicit):
        ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def gspmd_step(m, o, b):  # the model's own annotations honoured by the compiler
        loss, grads = nnx.value_and_grad(loss_fn)(m, b)
        o.update(m, grads)
        return loss

    for i in range(3):
        state, metrics = step(state, _batch(i))
        with jax.set_mesh(explicit):
            want = float(gspmd_step(ref, ref_opt, _batch(i)))
        np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
    qnnx.update(model, state)
    np.testing.assert_allclose(
        np.asarray(model.lin.kernel[...]), np.asarray(jax.device_get(ref.lin.kernel[...])), rtol=1e-4, atol=1e-6
    )


def test_an_annotation_the_model_makes_itself_names_the_rule(mesh):
    with jax.set_mesh(mesh):
        model = Annotated(nnx.Rngs(0), constrain=True)
    opt = q.optim.qsdp(optax.adam(1e-2), CFG)
    state = qnnx.init_state(model, opt, mesh, CFG)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, CFG)
    with pytest.raises(ValueError, match=r"places an array on the mesh inside the step .*ignores the out_sharding"):
        step(state, _batch(0))
    assert type(model.emb) is nnx.Embed  # the user's module keeps its classes
