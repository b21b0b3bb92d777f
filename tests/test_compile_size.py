"""What XLA:CPU compiles per leaf of the step (its compile time is the LLVM code of its kernels).

* The finiteness flag of all the gradients is computed once, not fused into every leaf's update
  (XLA:CPU fused the and of every leaf's flag into each leaf's update kernel: code quadratic in
  the leaves, 82% of the LLVM IR of a 6-block list GPT at W8G8; Gemma 3 270M's shapes as a list,
  W8G8: 86.1 -> 22.9 s).
* ``cpu_boundary`` compiles its function once (its conditional's other branch is zeros).
* The weight projection onto the grid (noise, bucket statistics, stochastic rounding) is computed
  once per leaf, not fused again into each of its consumers.
* Leaves of one shape share their kernels (XLA:CPU compiles each distinct kernel once).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsdp_jax as q
from qsdp_jax._src.quant.payload import cpu_boundary


def _compiled_step(n_leaves: int, config: q.QSDPConfig, shape=(64,)) -> str:
    params = {f"w{i}": jnp.full(shape, 0.1 * i) for i in range(n_leaves)}
    mesh = q.make_mesh()
    opt = q.optim.qsdp(optax.adam(1e-3), config)
    state = q.init_train_state(params, opt, mesh, config)

    def loss(p, batch):
        return sum(jnp.sum(p.gather(f"w{i}") ** 2) for i in range(n_leaves)) * jnp.mean(batch["x"])

    batch = {"x": jnp.ones((8, 4))}
    return q.make_train_step(loss, opt, mesh, config).lower(state, batch).compile().as_text()


def _computations(text: str) -> list[str]:
    return re.findall(r"\n%[\w.\-]+ \([^\n]*\{\n(.*?)\n\}", text, re.S)


def _most_ands_in_a_computation(n_leaves: int, config: q.QSDPConfig) -> int:
    return max(len(re.findall(r"= pred\[\] and\(", b)) for b in _computations(_compiled_step(n_leaves, config)))


@pytest.mark.parametrize("config", [q.QSDPConfig.fp32(bucket_size=64, min_shard_size=64)], ids=["fp32"])
def test_no_computation_ands_every_leafs_flag(config):
    few, many = _most_ands_in_a_computation(4, config), _most_ands_in_a_computation(32, config)
    assert many <= few + 2, (few, many)  # not one more `and` per leaf in some kernel


@pytest.mark.parametrize("first", [0.0, -3.0, np.nan, np.inf])
def test_cpu_boundary_compiles_its_function_once_and_returns_it_for_any_data(first):
    x = jnp.linspace(-1.0, 1.0, 256).at[0].set(first)
    fn = lambda v: (jnp.sin(v) * 3.0, jnp.cos(v) + 1.0)  # noqa: E731
    lowered = jax.jit(lambda v: cpu_boundary(fn, v)).lower(x)
    assert lowered.as_text().count("stablehlo.sine") == 1  # lowered once, not per platform
    compiled = lowered.compile()
    text = compiled.as_text()
    assert "conditional(" in text  # the boundary stands: XLA did not fold the predicate
    assert len(re.findall(r" sine\(", text)) == 1, text  # fn once, not in both branches
    for got, want in zip(compiled(x), fn(x)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_weight_projection_is_compiled_once_per_leaf():
    # per leaf: the projection's stochastic rounding, and the gradient's on the reduce-scatter
    # (and its backward's). Fused into its consumers, the projection came 4 times per leaf.
    config = q.QSDPConfig.qsdp(8, 8, bucket_size=64, min_shard_size=64)
    floors = [sum(" floor(" in b for b in _computations(_compiled_step(n, config, (64, 64)))) for n in (2, 6)]
    assert (floors[1] - floors[0]) / 4 <= 3, floors


def _distinct_hash_computations(text: str) -> int:
    bodies = {re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", b)) for b in _computations(text)}
    return sum(" xor(" in b for b in bodies)


def test_alike_leaves_share_their_hash_kernels():
    """Leaves of one shape share the kernels of their randomness: the projection's key is
    derived from the leaf's index as a value XLA cannot see (``alike.opaque_ints``). With the
    index a constant, each leaf had a key kernel of its own (108 of Gemma 3 270M's 515 distinct
    kernels on XLA:CPU, which compiles each distinct kernel once). Gradients in float32 here:
    the gradient keys of groups outside a chain of blocks still hold their group's index."""
    config = q.QSDPConfig.qsdp(8, None, bucket_size=64, min_shard_size=64)
    few, many = (_distinct_hash_computations(_compiled_step(n, config, (64, 64))) for n in (2, 8))
    assert many == few, (few, many)
