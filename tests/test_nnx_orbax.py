"""A checkpoint of an NNX state restores into the module with plain orbax and
nnx.replace_by_pure_dict, in a process that never imports qsdp_jax: the params are stored as
the module nests them (a list of blocks, a nested list, a layer stack), and qsdp_jax's own
restore of it is exact."""

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

    def flat_params(model):
        pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return {"/".join(map(str, k)): v for k, v in nnx.traversals.flatten_mapping(pure).items()}
""")

PLAIN = MODEL + textwrap.dedent("""
    import json, sys
    import numpy as np
    import orbax.checkpoint as ocp

    restored = ocp.PyTreeCheckpointer().restore(sys.argv[1])  # <ckdir>/<step>/arrays
    model = Model(nnx.Rngs(1))  # other initial weights: the restore must replace them all
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, nnx.restore_int_paths(restored["params"]))
    nnx.update(model, state)
    np.savez(sys.argv[2], **{k: np.asarray(v) for k, v in flat_params(model).items()})
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
    want = namespace["flat_params"](model)

    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck" / "2" / "arrays"), str(tmp_path / "out.npz")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    assert sorted(got.files) == sorted(want) and len(want) == 21  # every parameter, by module path
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], np.asarray(v), err_msg=k)  # bit for bit
