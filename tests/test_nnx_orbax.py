"""A checkpoint of an NNX state restores into the module and an nnx.Optimizer with plain orbax
and nnx.replace_by_pure_dict, in a process that never imports qsdp_jax: the params are stored as
the module nests them (a list of blocks, a nested list, a layer stack), the base optimizer's
state as nnx.Optimizer keys it, and qsdp_jax's own restore of it is exact."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import qsdp_jax as q
from qsdp_jax import nnx as qnnx

REPO = Path(__file__).resolve().parent.parent
CFG = q.QSDPConfig.qsdp(8, 8, bucket_size=64, min_shard_size=64)
OUT = ("params.npz", "optimizer.npz")

MODEL = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.lin = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            return x + self.lin(self.ln(x))

    class Trunk(nnx.Module):
        def __init__(self, d, rngs):
            self.layers = nnx.List([Block(d, rngs) for _ in range(2)])
            self.norm = nnx.LayerNorm(d, rngs=rngs)

        def __call__(self, x):
            for b in self.layers:
                x = b(x)
            return self.norm(x)

    class Model(nnx.Module):
        def __init__(self, rngs, d=32):
            self.embed = nnx.Embed(64, d, rngs=rngs)
            self.blocks = nnx.List([Block(d, rngs) for _ in range(2)])
            self.trunk = Trunk(d, rngs)
            self.head = nnx.Linear(d, 64, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.head(self.trunk(x))

    def flat(state):
        pure = nnx.to_pure_dict(state)
        return {"/".join(map(str, k)): v for k, v in nnx.traversals.flatten_mapping(pure).items()}
""")

PLAIN = MODEL + textwrap.dedent("""
    import json, sys
    import numpy as np
    import orbax.checkpoint as ocp

    import optax

    restored = nnx.restore_int_paths(ocp.PyTreeCheckpointer().restore(sys.argv[1]))  # <ckdir>/<step>/arrays
    model = Model(nnx.Rngs(1))  # other initial weights: the restore must replace them all
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, restored["params"])
    nnx.update(model, state)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)  # fresh moments, step 0
    opt_state = nnx.state(opt)
    nnx.replace_by_pure_dict(opt_state, {"opt_state": restored["opt_state"], "step": restored["step"]})
    nnx.update(opt, opt_state)
    np.savez(sys.argv[2], **{k: np.asarray(v) for k, v in flat(nnx.state(model, nnx.Param)).items()})
    np.savez(sys.argv[3], **{k: np.asarray(v) for k, v in flat(nnx.state(opt)).items()})
    assert "qsdp_jax" not in sys.modules
""")

namespace: dict = {}
exec(MODEL, namespace)  # the same classes here
Model = namespace["Model"]


def _loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def test_a_plain_orbax_script_restores_the_module(tmp_path):
    mesh = q.make_mesh()
    model = Model(nnx.Rngs(0))
    opt = q.optim.qsdp(optax.adam(1e-2), CFG)
    state = qnnx.init_state(model, opt, mesh, CFG)
    step = qnnx.make_train_step(model, _loss, opt, mesh, CFG)
    tokens = jax.random.randint(jax.random.key(0), (16, 9), 0, 64)
    for _ in range(2):
        state, _ = step(state, {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]})
    with q.Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(state, CFG, mesh)
        restored, _ = ckpt.restore(state, CFG, mesh)
    for a, b in zip(jax.tree.leaves(q.gather_params(restored)), jax.tree.leaves(q.gather_params(state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # our own restore: exact
    qnnx.update(model, state)
    want = namespace["flat"](nnx.state(model, nnx.Param))
    # what an nnx.Optimizer over the same adam holds after the same steps, keyed as it keys it
    inner = state.opt_state.inner[0]
    want_opt = {"step": np.asarray(state.step), "opt_state/0/count": np.asarray(inner.count)}
    for name in ("mu", "nu"):
        for path, v in jax.tree_util.tree_flatten_with_path(getattr(inner, name))[0]:
            keys = [k for e in path for k in str(getattr(e, "key", getattr(e, "name", e))).split("/")]
            want_opt["/".join(["opt_state", "0", name, *keys])] = np.asarray(v)

    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck" / "2" / "arrays"), *(str(tmp_path / f) for f in OUT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got, got_opt = (np.load(tmp_path / f) for f in OUT)
    assert sorted(got.files) == sorted(want) and len(want) == 21  # every parameter, by module path
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], np.asarray(v), err_msg=k)  # bit for bit
    assert sorted(got_opt.files) == sorted(want_opt) and len(want_opt) == 2 + 2 * 21  # step, count, moments
    for k, v in want_opt.items():
        np.testing.assert_array_equal(got_opt[k], v, err_msg=k)


def test_a_checkpoint_of_the_earlier_nnx_layout_still_reads():
    """Before the optimizer state was nested, an NNX checkpoint stored its params by module path
    (``meta["module_paths"]``) and the other leaves under record names: read as it was."""
    from qsdp_jax._src.checkpoint.arrays import from_item

    w, mu, step = np.arange(6.0).reshape(2, 3), np.ones((2, 3)), np.asarray(7)
    got = {"params": {"trunk": {"layers": {"0": {"w": w}}}}, "state": {"leaf_0000": mu, "leaf_0001": step}}
    leaf_w, leaf_mu = ".params['trunk/layers/0']['w']", ".opt_state.inner[0].mu['trunk/layers/0']['w']"
    meta = {
        "module_paths": {"trunk/layers/0/w": leaf_w},
        "names": {leaf_mu: "leaf_0000", ".step": "leaf_0001"},
        "leaves": {
            leaf_w: [[2, 3], "float64"],
            leaf_mu: [[2, 3], "float64"],
            ".step": [[], "int64"],
            ".e": [[0], "f4"],
        },
    }
    out = from_item(got, meta)
    assert sorted(out) == sorted(meta["leaves"])
    for k, v in ((leaf_w, w), (leaf_mu, mu), (".step", step)):
        np.testing.assert_array_equal(out[k], v)
    assert out[".e"].shape == (0,)
