"""The NNX front door's ``take_embeddings``: ``nnx.Embed`` lookups read rows from the devices'
blocks, the same step bit for bit as the ParamAccess GPT with ``embed_lookup="take"``, no
whole table for an untied model's lookups, and a tied table read by ``attend`` gathered at the
head only."""

import dataclasses
import math
import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from experiments.gpt.gemma_like import GemmaLike, loss_fn
from experiments.gpt.model import GPT, GPTConfig
from experiments.gpt.model_nnx import GPTListModel, GPTModel, gpt_loss
from qsdp_jax import nnx as qnnx

# 1024 rows: more than the 8 devices' 128 ids, so the token table is read as rows; the
# 16-row position table is gathered alone
CFG = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4, vocab_size=1024)
SMALL = dict(bucket_size=64, min_shard_size=128)
STEPS = 2


def _batch(i):
    k1, k2 = jax.random.split(jax.random.key(i))
    return {
        "inputs": jax.random.randint(k1, (8, 16), 0, CFG.vocab_size, jnp.int32),
        "targets": jax.random.randint(k2, (8, 16), 0, CFG.vocab_size, jnp.int32),
    }


def _low_level(cfg, config):
    gpt = GPT(dataclasses.replace(cfg, embed_lookup="take"))
    opt = q.optim.qsdp(optax.adam(1e-2), config)
    state = q.init_train_state(gpt.init_params(0), opt, q.make_mesh(), config, stacked=gpt.stacked_groups)
    step = q.make_train_step(gpt.loss, opt, q.make_mesh(), config)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return losses, q.gather_params(state)


def _front_door(cfg, config, cls=GPTModel, take=True):
    model = cls.init(cfg, 0)
    opt = q.optim.qsdp(optax.adam(1e-2), config)
    state = qnnx.init_state(model, opt, q.make_mesh(), config)
    step = qnnx.make_train_step(model, gpt_loss, opt, q.make_mesh(), config, take_embeddings=take)
    compiled = step.lower(state, _batch(0)).compile()
    losses = []
    for i in range(STEPS):
        state, metrics = compiled(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return losses, state, step, compiled


@pytest.mark.parametrize("config", [q.QSDPConfig.fp32(**SMALL), q.QSDPConfig.qsdp(8, 8, **SMALL)], ids=["fp32", "W8G8"])
def test_front_door_takes_rows_like_the_paramaccess_gpt(config):
    losses, state, step, _ = _front_door(CFG, config)
    low, low_params = _low_level(CFG, config)
    assert losses == low
    chex.assert_trees_all_equal(q.gather_params(state), low_params)
    table = step.summary(state, _batch(0))
    assert "embed" in table and "whole" in table  # the tied table: gathered for attend alone


def test_untied_lookups_never_gather_the_table():
    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    config = q.QSDPConfig.fp32(**SMALL)
    losses, state, step, compiled = _front_door(cfg, config, cls=GPTListModel)
    low, low_params = _low_level(cfg, config)
    chex.assert_trees_all_close(losses, low, rtol=1e-6)
    table = step.summary(state, _batch(0))
    assert "rows" in table and "never gathered" in table, table
    assert "f32[1024,32]" not in compiled.as_text()
    plain = _front_door(cfg, config, cls=GPTListModel, take=False)[3]
    assert "f32[1024,32]" in plain.as_text()


def _gather_sizes(hlo: str) -> list[int]:
    """Element counts of the scheduled entry computation's all-gathers, in schedule order."""
    entry = hlo[hlo.index("\nENTRY") :]
    return [math.prod(map(int, d.split(","))) for d in re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", entry)]


@pytest.mark.parametrize("take", [True, False], ids=["take", "read"])
def test_a_tied_table_read_by_attend_is_gathered_at_the_head(take):
    """A list of resharded blocks between a tied lookup and its ``attend``: with the lookup
    taking rows, the table's one gather comes after every block's forward gather but the last
    block's (it waits for the last call's inputs), so no whole table is held across the blocks;
    a lookup that reads the table gathers it before the first block."""
    vocab, d, layers = 4096, 64, ("local", "global") * 2
    with jax.set_mesh(jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))):
        model = nnx.eval_shape(lambda: GemmaLike(nnx.Rngs(0), vocab=vocab, d=d, layers=layers))
    config = q.QSDPConfig.fp32(**SMALL)
    opt = q.optim.qsdp(optax.adam(1e-3), config)
    state = qnnx.abstract_state(model, opt, q.make_mesh(), config)
    step = qnnx.make_train_step(model, loss_fn, opt, q.make_mesh(), config, take_embeddings=take)
    batch = {k: jax.ShapeDtypeStruct((8, 32), dt) for k, dt in (("inputs", jnp.int32), ("targets", jnp.int32))}
    batch["input_mask"] = jax.ShapeDtypeStruct((8, 32), jnp.bool_)
    sizes = _gather_sizes(step.lower(state, batch).compile().as_text())
    block = {
        x.size for x in jax.tree.leaves(nnx.state(model.blocks[0], nnx.Param)) if x.size >= SMALL["min_shard_size"]
    }
    assert sizes.count(vocab * d) == 1, sizes  # the table once (the lookup takes rows or reads it)
    at = sizes.index(vocab * d)
    before = sum(n in block for n in sizes[:at])
    forward = sum(n in block for n in sizes) // 2  # each block gathered in the forward and again in the backward
    if take:
        assert before >= forward - forward // len(layers), (before, forward, sizes)
    else:
        assert before <= forward // len(layers), (before, forward, sizes)


class _Tok(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.proj = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, ids):
        return self.proj(self.embed(ids))


class _Scaled(nnx.Embed):
    """A subclass with a ``__call__`` of its own: left to read its table."""

    def __call__(self, inputs, out_sharding=None):
        return 2.0 * super().__call__(inputs, out_sharding=out_sharding)


class _Model(nnx.Module):
    """``emb``: a group of one table (its lookups read rows); ``tok``: a table and a layer called
    as a module (resharded: its lookup runs inside the call and reads the gathered table);
    ``scaled``: an ``nnx.Embed`` subclass with its own ``__call__`` (not changed)."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(64, 16, rngs=rngs)
        self.tok = _Tok(rngs)
        self.scaled = _Scaled(64, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, ids):
        return self.out(jnp.tanh(self.emb(ids) + self.tok(ids) + self.scaled(ids))).mean(1)


def _toy_run(take, config):
    model = _Model(nnx.Rngs(0))
    opt = q.optim.qsdp(optax.sgd(0.5), config)
    state = qnnx.init_state(model, opt, q.make_mesh(), config)
    loss = lambda m, b: jnp.mean((m(b["ids"]) - b["y"]) ** 2)  # noqa: E731
    step = qnnx.make_train_step(model, loss, opt, q.make_mesh(), config, take_embeddings=take)
    batch = {"ids": jax.random.randint(jax.random.key(1), (8, 3), 0, 64), "y": jnp.ones((8, 4))}
    state, metrics = step(state, batch)
    return float(metrics["loss"]), q.gather_params(state), step.summary(state, batch)


def test_tables_called_inside_a_resharded_group_or_by_their_own_call_read_the_table():
    config = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=128)
    taken, taken_params, summary = _toy_run(True, config)
    plain, plain_params, _ = _toy_run(False, config)
    assert taken == plain
    chex.assert_trees_all_close(taken_params, plain_params, rtol=1e-6, atol=1e-7)
    init = qnnx.init_state(_Model(nnx.Rngs(0)), q.optim.qsdp(optax.sgd(0.5), config), q.make_mesh(), config)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), taken_params, q.gather_params(init))
    assert min(jax.tree.leaves(moved)) > 0  # every table and layer got its gradient
    rows = {line.split()[0]: line for line in summary.splitlines()[1:-1]}
    assert "rows" in rows["emb"] and "per call" in rows["tok"] and "per call" in rows["scaled"], summary
