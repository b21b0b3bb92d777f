"""The GPT of ``experiments.gpt.model`` as an ordinary Flax NNX module, trained through
``qsdp_jax.nnx`` with its own ``__call__``.

The blocks are one layer stack made with ``nnx.split_rngs`` + ``nnx.vmap``; the forward scans
them with ``qsdp_jax.nnx.scan`` (``nnx.scan`` outside the sharded step, one layer gathered at a
time inside it) over an ``nnx.remat`` body. Parameter names and shapes are those of
``experiments.gpt.model.GPT.init_params`` (groups ``embed``, ``blocks``, ``head``), so
:meth:`GPTModel.from_params` takes its parameters and the two paths compute the same step.

:class:`GPTListModel` is the same model with its blocks in an ``nnx.List`` called in a Python
loop, as most NNX transformers are written.

Usage::

    model = GPTModel(GPTConfig.from_preset("tiny"), rngs=nnx.Rngs(0))
    logits = model(tokens_BxL)
    loss = gpt_loss(model, {"inputs": x_BxL, "targets": y_BxL})
"""

from __future__ import annotations

import functools
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


class _GPTBase(nnx.Module):
    """Embedding, a trunk of blocks (:meth:`trunk`, per subclass), final norm and (tied, by
    default) output projection."""

    cfg: GPTConfig
    embed: Embedding
    head: Head

    def trunk(self, x_BxLxD: jax.Array) -> jax.Array:
        raise NotImplementedError

    def __call__(self, inputs_BxL: jax.Array) -> jax.Array:
        """float32 logits ``[B, L, vocab]`` for int ``inputs`` ``[B, L]`` (L <= seq_len)."""
        _check_inputs(self.cfg, inputs_BxL, "inputs")
        h_BxLxD = self.head.ln_f(self.trunk(self.embed(inputs_BxL)))
        if self.cfg.tie_embeddings:
            logits_BxLxV = self.embed.attend(h_BxLxD)
        else:
            logits_BxLxV = self.head.out(h_BxLxD)
        return logits_BxLxV.astype(jnp.float32)

    @classmethod
    def _module_params(cls, cfg: GPTConfig, params: dict) -> dict:
        """``params`` (of ``GPT(cfg).init_params``) in this module's own layout."""
        return params

    @classmethod
    def from_params(cls, cfg: GPTConfig, params: dict):
        """The module holding ``params`` (as from ``GPT(cfg).init_params``), without
        initialising anything else."""
        params = cls._module_params(cfg, params)
        abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))  # type: ignore[call-arg]
        graphdef, state = nnx.split(abstract)
        want = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.to_pure_dict(state))
        have = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), params)
        if want != have:
            raise ValueError(f"params do not fit {cls.__name__}({cfg}): shapes {have}, expected {want}")
        return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))

    @classmethod
    def init(cls, cfg: GPTConfig, seed: int = 0):
        """The module with ``GPT(cfg).init_params(seed)``: the initial weights of the
        ``ParamAccess`` GPT (its layers drawn one by one, not from split streams)."""
        return cls.from_params(cfg, GPT(cfg).init_params(seed))


class GPTModel(_GPTBase):
    """Token + position embedding, ``n_layers`` pre-norm blocks (one ``nnx.vmap`` stack, scanned
    with ``q.nnx.scan``), final norm and (tied, by default) output projection."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.head = Head(cfg, rngs=rngs)

    def trunk(self, x_BxLxD: jax.Array) -> jax.Array:
        return _trunk(x_BxLxD, self.blocks)


class GPTListModel(_GPTBase):
    """The same GPT written the most common way: the blocks in an ``nnx.List``, called in a
    Python loop (each block a group of its own, ``"blocks/0"``, ...: gathered per call and again
    in the backward pass by the front door's reshard-after-forward)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embedding(cfg, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.head = Head(cfg, rngs=rngs)

    def trunk(self, x_BxLxD: jax.Array) -> jax.Array:
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return x_BxLxD

    @classmethod
    def _module_params(cls, cfg: GPTConfig, params: dict) -> dict:
        """The ``"blocks"`` stack cut into one block per list entry."""
        blocks = params["blocks"]
        return {
            **params,
            "blocks": {i: jax.tree.map(functools.partial(_row, i=i), blocks) for i in range(cfg.n_layers)},
        }


def _row(x: jax.Array, i: int) -> jax.Array:
    return x[i]


def gpt_loss(model: _GPTBase, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (float32 scalar, nats/byte), the ordinary NNX way."""
    inputs_BxL, targets_BxL = _check_batch(model.cfg, batch)
    return cross_entropy(model(inputs_BxL), targets_BxL)
