"""experiments.shelf.gspmd_fsdp: the plain jax.jit + NamedSharding FSDP step, the benchmarks' baseline."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import qsdp_jax as q
from experiments.bench import memory as bench_memory
from experiments.shelf import gspmd_fsdp
from experiments.gpt.model import GPT, GPTConfig
from qsdp_jax.access import LocalParams


def _batches(cfg, n_steps, batch_size, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, size=(n_steps, batch_size, cfg.seq_len + 1))
    return [{"inputs": jnp.asarray(t[:, :-1], jnp.int32), "targets": jnp.asarray(t[:, 1:], jnp.int32)} for t in tokens]


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_three_steps_match_the_one_device_optax_loop():
    model = GPT(GPTConfig.from_preset("tiny", seq_len=32))
    mesh = q.make_mesh()  # 8 simulated devices, axis "fsdp"
    assert mesh.shape["fsdp"] == 8
    opt = optax.adam(1e-3)
    params, opt_state = gspmd_fsdp.init_state(model, mesh, jax.random.key(0), opt)
    # really sharded: the largest embedding is split 8 ways, adam's moments like it
    tok = params["embed"]["tok"]["embedding"]
    assert tok.sharding.spec == P("fsdp", None)
    assert tok.addressable_shards[0].data.shape == (256 // 8, 128)
    assert opt_state[0].mu["embed"]["tok"]["embedding"].sharding.spec == P("fsdp", None)
    assert opt_state[0].count.sharding.spec == P()

    ref = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)  # the same values, one device
    ref_opt = opt.init(ref)

    @jax.jit
    def ref_step(p, o, batch):
        loss, grads = jax.value_and_grad(lambda p: model.loss(LocalParams(p), batch))(p)
        updates, o = opt.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    step = gspmd_fsdp.make_step(model, opt, mesh)
    for batch in _batches(model.cfg, 3, 8):
        params, opt_state, loss = step(params, opt_state, batch)
        ref, ref_opt, ref_loss = ref_step(ref, ref_opt, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert jax.tree.structure(params) == jax.tree.structure(ref)
    # Adam's first steps move every element by about sign(grad) * lr, so an element whose
    # gradient is at rounding level can flip between the two summation orders: elementwise
    # rtol is meaningless there. Compared instead: each leaf's relative L2 error, and every
    # element to a small fraction of one step. The key bias has an identically zero gradient
    # (softmax is invariant to it), so adam moves it by rounding noise only: both stay ~0.
    lr = 1e-3
    diff2 = norm2 = 0.0
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        b = np.asarray(_at(ref, path), np.float64)
        a = np.asarray(a, np.float64)
        name = jax.tree_util.keystr(path)
        assert np.abs(a - b).max() < 0.1 * lr, name
        if name == "['blocks']['attn']['k']['bias']":
            assert np.abs(a).max() < 0.01 * lr and np.abs(b).max() < 0.01 * lr
            continue
        assert np.linalg.norm(a - b) <= 5e-5 * np.linalg.norm(b), name
        diff2 += np.sum((a - b) ** 2)
        norm2 += np.sum(b**2)
    assert np.sqrt(diff2) <= 1e-5 * np.sqrt(norm2)
    # still sharded after the steps (out_shardings)
    assert params["embed"]["tok"]["embedding"].sharding.spec == P("fsdp", None)


def test_leaf_spec_picks_the_largest_divisible_dimension():
    assert gspmd_fsdp.leaf_spec((256, 128), 8, False) == P("fsdp", None)
    assert gspmd_fsdp.leaf_spec((100, 64), 8, False) == P(None, "fsdp")  # 100 % 8 != 0
    assert gspmd_fsdp.leaf_spec((128, 128), 8, False) == P("fsdp", None)  # tie: the first
    assert gspmd_fsdp.leaf_spec((7, 5), 8, False) == P()  # nothing divides: replicated
    assert gspmd_fsdp.leaf_spec((), 8, False) == P()  # a scalar
    # stacked: never the layer axis, even when it is the largest divisible one
    assert gspmd_fsdp.leaf_spec((16, 8, 3), 8, True) == P(None, "fsdp", None)
    assert gspmd_fsdp.leaf_spec((16, 8, 3), 8, False) == P("fsdp", None, None)
    assert gspmd_fsdp.leaf_spec((8, 3), 8, True) == P()


def test_abstract_state_allocates_nothing_and_shards_like_init():
    model = GPT(GPTConfig.from_preset("tiny"))
    mesh = q.make_mesh()
    params, opt_state = gspmd_fsdp.abstract_state(model, mesh)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves((params, opt_state)))
    kernel = params["blocks"]["mlp"]["fc"]["kernel"]  # [n_layers, D, 4D]
    assert kernel.sharding.spec == P(None, None, "fsdp")
    assert opt_state[0].nu["blocks"]["mlp"]["fc"]["kernel"].sharding.spec == P(None, None, "fsdp")


def test_bench_memory_measures_the_gspmd_step():
    r = bench_memory.measure("tiny", "gspmd", 2)
    assert r["scheme"] == "gspmd" and r["n_devices"] == 2
    assert r["peak_bytes"] > 0
    assert r["peak_bytes"] == (r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"])
    assert 0 < r["state_bytes"] < r["ideal_1_layer_bytes"] <= r["peak_bytes"]
    text = bench_memory.table([r, {**r, "scheme": "fp32", "peak_bytes": 2 * r["peak_bytes"]}])
    assert "vs gspmd" in text and "2.00x" in text
