"""A Gemma-3-like Flax NNX transformer written the way the Flax team's ``examples/gemma`` writes
one (our code, not theirs): blocks in an ``nnx.List`` alternating local (sliding-window) and
global attention, RoPE, grouped-query attention, RMSNorm, a gated MLP, a tied embedding read back
through ``attend``, dropout built without rngs and given its keys in ``__call__``, partitioned
parameters and ``out_sharding`` on every call, and the loss of a padded batch normalised by its
real tokens (``q.WeightedMean``). Used by tests/test_gemma_like.py and, at Gemma-3-270M's shapes
(``GEMMA3_270M``), by ``experiments.bench.compile_nnx``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import qsdp_jax as q

ACT = P("fsdp", None, None)  # activations: batch over the fsdp axis, as the example's fsdp config


def _part(init, names):
    return nnx.with_partitioning(init, names)


def rope(x, base: float = 10_000.0):
    """Rotary position embedding over the last axis of ``x`` (batch, time, heads, head_dim)."""
    t, half = x.shape[1], x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class Attention(nnx.Module):
    def __init__(self, d, heads, kv_heads, window, dropout, rngs, head_dim=None):
        self.heads, self.kv_heads, self.hd, self.window = heads, kv_heads, head_dim or d // heads, window
        k_init = nnx.initializers.lecun_normal()
        self.q = nnx.Linear(d, heads * self.hd, use_bias=False, kernel_init=_part(k_init, ("fsdp", None)), rngs=rngs)
        self.kv = nnx.Linear(
            d, 2 * kv_heads * self.hd, use_bias=False, kernel_init=_part(k_init, ("fsdp", None)), rngs=rngs
        )
        self.o = nnx.Linear(heads * self.hd, d, use_bias=False, kernel_init=_part(k_init, (None, "fsdp")), rngs=rngs)
        self.drop = nnx.Dropout(dropout)

    def __call__(self, x, rngs):
        b, t, _ = x.shape
        q = rope(self.q(x, out_sharding=ACT).reshape(b, t, self.heads, self.hd))
        k, v = jnp.split(self.kv(x, out_sharding=ACT).reshape(b, t, 2 * self.kv_heads, self.hd), 2, axis=2)
        k = jnp.repeat(rope(k), self.heads // self.kv_heads, axis=2)
        v = jnp.repeat(v, self.heads // self.kv_heads, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(self.hd).astype(x.dtype)
        pos = jnp.arange(t)
        allowed = pos[:, None] >= pos[None, :]
        if self.window is not None:  # a local layer: the last `window` positions only
            allowed &= pos[:, None] - pos[None, :] < self.window
        probs = self.drop(jax.nn.softmax(jnp.where(allowed, scores, -1e9), axis=-1), rngs=rngs)
        out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, self.heads * self.hd)
        return self.o(out, out_sharding=ACT)


class Block(nnx.Module):
    def __init__(self, d, heads, kv_heads, window, dropout, rngs, hidden=None, head_dim=None):
        hidden = hidden or 2 * d
        self.pre_attn = nnx.RMSNorm(d, rngs=rngs)
        self.attn = Attention(d, heads, kv_heads, window, dropout, rngs, head_dim)
        self.pre_mlp = nnx.RMSNorm(d, rngs=rngs)
        k_init = nnx.initializers.lecun_normal()
        self.gate = nnx.Linear(d, hidden, use_bias=False, kernel_init=_part(k_init, ("fsdp", None)), rngs=rngs)
        self.up = nnx.Linear(d, hidden, use_bias=False, kernel_init=_part(k_init, ("fsdp", None)), rngs=rngs)
        self.down = nnx.Linear(hidden, d, use_bias=False, kernel_init=_part(k_init, (None, "fsdp")), rngs=rngs)
        self.drop = nnx.Dropout(dropout)

    def __call__(self, x, rngs):
        x = x + self.attn(self.pre_attn(x), rngs)
        h = self.pre_mlp(x)
        mlp = self.down(jax.nn.gelu(self.gate(h, out_sharding=ACT)) * self.up(h, out_sharding=ACT), out_sharding=ACT)
        return x + self.drop(mlp, rngs=rngs)


class GemmaLike(nnx.Module):
    def __init__(
        self,
        rngs,
        vocab=64,
        d=32,
        heads=4,
        kv_heads=2,
        layers=("local", "global", "local"),
        window=4,
        dropout=0.0,
        hidden=None,
        head_dim=None,
    ):
        embed_init = _part(nnx.initializers.normal(0.5), ("fsdp", None))
        self.embed = nnx.Embed(vocab, d, embedding_init=embed_init, rngs=rngs)
        self.blocks = nnx.List(
            [
                Block(d, heads, kv_heads, window if kind == "local" else None, dropout, rngs, hidden, head_dim)
                for kind in layers
            ]
        )
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)
        self.scale = d**0.5

    def __call__(self, tokens, rngs=None):
        x = self.embed(tokens, out_sharding=ACT) * self.scale
        for block in self.blocks:
            x = block(x, rngs)
        return self.embed.attend(self.final_norm(x), out_sharding=ACT)  # tied: the table again


# Gemma 3 270M's shapes (its model card's config): 18 layers, five local (window 512) to one
# global, d 640, 4 query heads of 256 over 1 key/value head, MLP 2048, a 262144-token vocabulary.
GEMMA3_270M = dict(
    vocab=262144, d=640, heads=4, kv_heads=1, head_dim=256, hidden=2048, window=512,
    layers=(("local",) * 5 + ("global",)) * 3,
)  # fmt: skip


def loss_fn(model, batch, rngs=None):
    """Summed token losses over the batch's real tokens (pads masked out), as a global ratio."""
    logits = model(batch["inputs"], rngs=rngs)
    losses = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    mask = batch["input_mask"].astype(jnp.float32)
    return q.WeightedMean(total=jnp.sum(losses * mask), weight=jnp.sum(mask))


def padded_batch(i: int, rows: int = 16, t: int = 12, vocab: int = 64) -> dict:
    """Rows padded to different lengths (2..12 real tokens; pad id 0), as a padded LM pipeline
    gives them; each device's rows hold a different number of real tokens."""
    key_tokens, key_lengths = jax.random.split(jax.random.key(1000 + i))
    tokens = jax.random.randint(key_tokens, (rows, t + 1), 1, vocab)
    lengths = jax.random.randint(key_lengths, (rows, 1), 2, t + 2)
    tokens = jnp.where(jnp.arange(t + 1)[None, :] < lengths, tokens, 0)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "input_mask": tokens[:, 1:] > 0}
