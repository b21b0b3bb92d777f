"""The GPT of ``experiments.gpt.model`` as an ordinary Flax NNX module, trained through
``qsdp_jax.nnx`` with its own ``__call__``.

The blocks are one layer stack made with ``nnx.split_rngs`` + ``nnx.vmap``; the forward scans
them with ``qsdp_jax.nnx.scan`` (``nnx.scan`` outside the sharded step, one layer gathered at a
time inside it) over an ``nnx.remat`` body. Parameter names and shapes are those of
``experiments.gpt.model.GPT.init_params`` (groups ``embed``, ``blocks``, ``head``), so
:meth:`GPTModel.from_params` takes its parameters and the two paths compute the same step.

Usage::

    model = GPTModel(GPTConfig.from_preset("tiny"), rngs=nnx.Rngs(0))
    logits = model(tokens_BxL)
    loss = gpt_loss(model, {"inputs": x_BxL, "targets": y_BxL})
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

import qsdp_jax.nnx as qnnx
from experiments.gpt.model import (
    GPT,
    Block,
    Embedding,
    GPTConfig,
    Head,
    _check_batch,
    _check_inputs,
    cross_entropy,
)


@qnnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
@nnx.remat
def _trunk(x_BxLxD: jax.Array, block: Block) -> jax.Array:
    return block(x_BxLxD)


class GPTModel(nnx.Module):
    """Token + position embedding, ``n_layers`` pre-norm blocks (one ``nnx.vmap`` stack), final
    norm and (tied, by default) output projection."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.head = Head(cfg, rngs=rngs)

    def __call__(self, inputs_BxL: jax.Array) -> jax.Array:
        """float32 logits ``[B, L, vocab]`` for int ``inputs`` ``[B, L]`` (L <= seq_len)."""
        _check_inputs(self.cfg, inputs_BxL, "inputs")
        x_BxLxD = _trunk(self.embed(inputs_BxL), self.blocks)
        h_BxLxD = self.head.ln_f(x_BxLxD)
        if self.cfg.tie_embeddings:
            logits_BxLxV = self.embed.attend(h_BxLxD)
        else:
            logits_BxLxV = self.head.out(h_BxLxD)
        return logits_BxLxV.astype(jnp.float32)

    @classmethod
    def from_params(cls, cfg: GPTConfig, params: dict) -> "GPTModel":
        """The module holding ``params`` (as from ``GPT(cfg).init_params``), without
        initialising anything else."""
        abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        want = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.to_pure_dict(state))
        have = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), params)
        if want != have:
            raise ValueError(f"params do not fit GPTModel({cfg}): shapes {have}, expected {want}")
        return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))

    @classmethod
    def init(cls, cfg: GPTConfig, seed: int = 0) -> "GPTModel":
        """The module with ``GPT(cfg).init_params(seed)``: the initial weights of the
        ``ParamAccess`` GPT (its layers drawn one by one, not from split streams)."""
        return cls.from_params(cfg, GPT(cfg).init_params(seed))


def gpt_loss(model: GPTModel, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (float32 scalar, nats/byte), the ordinary NNX way."""
    inputs_BxL, targets_BxL = _check_batch(model.cfg, batch)
    return cross_entropy(model(inputs_BxL), targets_BxL)
