"""A GPT (Flax NNX) for byte-level language modelling, written against :class:`ParamAccess`.

The model's parameters are a plain dict of *groups* of plain ``jnp`` arrays (no
``nnx.Variable`` objects), so that the sharded train step can shard, gather and re-create
them freely::

    {
      "embed":  {"tok": {"embedding": [V, D]}, "pos": {"embedding": [S, D]}},
      "blocks": {...one Block's pure dict, every leaf with a leading [n_layers] axis...},
      "head":   {"ln_f": {"scale": [D], "bias": [D]},
                 "out": {"kernel": [D, V]}},          # "out" only when not tied
    }

A ``Block``'s pure dict is::

    {"ln1": {"scale": [D], "bias": [D]},
     "attn": {"q"/"k"/"v"/"o": {"kernel": [D, D], "bias": [D]}},
     "ln2": {"scale": [D], "bias": [D]},
     "mlp": {"fc": {"kernel": [D, F], "bias": [F]}, "proj": {"kernel": [F, D], "bias": [D]}}}

The loss function receives a :class:`qsdp_jax.access.ParamAccess`: it gathers ``"embed"``
(or reads its rows with ``p.take``: ``GPTConfig.embed_lookup``), scans over ``"blocks"`` one
layer at a time (``p.scan``), and gathers ``"head"`` at the end.
NNX modules are rebuilt from the pure dicts on every call (``nnx.merge`` of a cached
``GraphDef`` with the pure dict), so no module object outlives a trace.

Usage::

    model = GPT(GPTConfig.from_preset("tiny"))
    params = model.init_params(seed=0)
    loss = model.loss(LocalParams(params), {"inputs": x_BxL, "targets": y_BxL})
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qsdp_jax.access import LocalParams, ParamAccess

PyTree = Any

EMBED = "embed"
BLOCKS = "blocks"
HEAD = "head"
GROUPS = (EMBED, BLOCKS, HEAD)
STACKED_GROUPS = (BLOCKS,)

LOOKUPS = ("gather", "take")
LN_EPS = 1e-5
INIT_STD = 0.02


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and dtype of a GPT. Validated at construction (``ValueError`` on a bad field).

    ``d_ff`` defaults to ``4 * d_model``. ``dtype`` is the compute dtype of the matmuls and
    norms (the loss is always computed in float32); ``param_dtype`` is the dtype the
    parameters are created in. Both are dtype names (``"float32"``, ``"bfloat16"``, ...).

    ``embed_lookup`` is how the token and position embeddings are read: ``"gather"`` (the
    default) from the gathered ``"embed"`` group, which a tied model gathers once for both
    ends (its two gradients summed and reduce-scattered together); ``"take"`` as rows
    (``ParamAccess.take``), so the sharded step never holds a whole table for the lookup and a
    tied table is gathered for the output projection alone. ``"take"`` moves every device's
    ``devices * tokens * d_model`` float32 rows forward and their gradient back: far less memory
    than the table where the vocabulary is large and the devices few (GPT-1.3B on 8 devices:
    199-300 MB less peak, +3.9% wire bytes per tied W8G8 step), more bytes than a small table
    (the byte-level presets, whose tables ``take`` gathers whole).
    """

    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int | None = None
    vocab_size: int = 256
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    embed_lookup: str = "gather"

    def __post_init__(self):
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for name in ("seq_len", "d_model", "n_layers", "n_heads", "d_ff", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"GPTConfig.{name}={value!r}: must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"GPTConfig.{name}={value}: must be positive")
            object.__setattr__(self, name, int(value))
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model}: must be divisible by "
                f"n_heads={self.n_heads} (d_model % n_heads == 0)"
            )
        if not isinstance(self.tie_embeddings, (bool, np.bool_)):
            raise ValueError(f"GPTConfig.tie_embeddings={self.tie_embeddings!r}: must be a bool")
        object.__setattr__(self, "tie_embeddings", bool(self.tie_embeddings))
        if self.embed_lookup not in LOOKUPS:
            raise ValueError(f"GPTConfig.embed_lookup={self.embed_lookup!r}: must be one of {LOOKUPS}")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            try:
                dt = jnp.dtype(value)
            except TypeError as e:
                raise ValueError(f"GPTConfig.{name}={value!r}: not a dtype name ({e})") from None
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a floating dtype")
            object.__setattr__(self, name, dt.name)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        """A preset from :data:`PRESETS` (trainable) or :data:`GPT2_SHAPES` (shape-only),
        with fields replaced by ``overrides``."""
        table = {**PRESETS, **GPT2_SHAPES}
        if name not in table:
            raise ValueError(
                f"unknown GPT preset {name!r}; presets are {sorted(PRESETS)} "
                f"(trainable) and {sorted(GPT2_SHAPES)} (shape-only)"
            )
        base = table[name]
        fields = dataclasses.asdict(base)
        if "d_model" in overrides and "d_ff" not in overrides:
            fields["d_ff"] = None  # keep the 4 * d_model default
        unknown = set(overrides) - set(fields)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {sorted(unknown)}; fields are {sorted(fields)}")
        fields.update(overrides)
        return cls(**fields)


# Byte-level presets, sized to train on a small CPU / one accelerator.
PRESETS: dict[str, GPTConfig] = {
    # ~0.44M params
    "tiny": GPTConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4),
    # ~3.3M params
    "small": GPTConfig(seq_len=128, d_model=256, n_layers=4, n_heads=4),
    # ~25.4M params
    "medium": GPTConfig(seq_len=256, d_model=512, n_layers=8, n_heads=8),
}

# GPT-2-like shapes, used only abstractly (``jax.eval_shape`` / :func:`abstract_params`)
# for communication-volume and memory estimates; never trained here.
GPT2_SHAPES: dict[str, GPTConfig] = {
    "gpt-125m": GPTConfig(seq_len=1024, d_model=768, n_layers=12, n_heads=12, vocab_size=50304),
    "gpt-350m": GPTConfig(seq_len=1024, d_model=1024, n_layers=24, n_heads=16, vocab_size=50304),
    "gpt-1.3b": GPTConfig(seq_len=1024, d_model=2048, n_layers=24, n_heads=32, vocab_size=50304),
    # Llama-2-7B and -13B shapes (width, depth, heads, 32000-token vocabulary): a 4x MLP of two
    # matrices holds as many weights as their 2.7x SwiGLU of three (6.5B and 12.7B here), for
    # the compile-for-real-targets benchmark (experiments/bench/aot.py) on 64 chips.
    "llama-7b-shape": GPTConfig(seq_len=1024, d_model=4096, n_layers=32, n_heads=32, vocab_size=32000),
    "llama-13b-shape": GPTConfig(seq_len=1024, d_model=5120, n_layers=40, n_heads=40, vocab_size=32000),
}


# --------------------------------------------------------------------------------------
# NNX modules
# --------------------------------------------------------------------------------------


def _normal(std: float):
    return nnx.initializers.normal(stddev=std)


def _linear(
    cfg: GPTConfig, d_in: int, d_out: int, rngs: nnx.Rngs, *, std: float = INIT_STD, use_bias: bool = True
) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=use_bias,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.params_dtype,
        kernel_init=_normal(std),
        bias_init=nnx.initializers.zeros_init(),
        rngs=rngs,
    )


def _layer_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        cfg.d_model,
        epsilon=LN_EPS,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.params_dtype,
        rngs=rngs,
    )


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with separate q, k, v, o projections."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        resid_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        self.q = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
        self.k = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
        self.v = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
        self.o = _linear(cfg, cfg.d_model, cfg.d_model, rngs, std=resid_std)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        B, L, _ = x_BxLxD.shape
        H, K = self.n_heads, self.head_dim
        q_BxLxHxK = self.q(x_BxLxD).reshape(B, L, H, K)
        k_BxLxHxK = self.k(x_BxLxD).reshape(B, L, H, K)
        v_BxLxHxK = self.v(x_BxLxD).reshape(B, L, H, K)
        # Scaled (1/sqrt(K)) softmax attention with a causal mask; XLA implementation so
        # that the result is deterministic and identical on every backend.
        y_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True, implementation="xla")
        return self.o(y_BxLxHxK.reshape(B, L, H * K))


class MLP(nnx.Module):
    """fc -> GELU -> proj."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        resid_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        assert cfg.d_ff is not None  # GPTConfig.__post_init__ fills the default
        self.fc = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
        self.proj = _linear(cfg, cfg.d_ff, cfg.d_model, rngs, std=resid_std)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x_BxLxD)))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(cfg, rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = _layer_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.ln1(x_BxLxD))
        x_BxLxD = x_BxLxD + self.mlp(self.ln2(x_BxLxD))
        return x_BxLxD


class Embedding(nnx.Module):
    """Token embedding + learned absolute position embedding."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype, embedding_init=_normal(INIT_STD), rngs=rngs)
        self.tok = nnx.Embed(cfg.vocab_size, cfg.d_model, **kw)
        self.pos = nnx.Embed(cfg.seq_len, cfg.d_model, **kw)

    def __call__(self, inputs_BxL: jax.Array) -> jax.Array:
        L = inputs_BxL.shape[-1]
        return self.tok(inputs_BxL) + self.pos(jnp.arange(L))[None]

    def attend(self, h_BxLxD: jax.Array) -> jax.Array:
        """Tied output projection: ``h @ tok.embedding.T``."""
        return self.tok.attend(h_BxLxD)


class Head(nnx.Module):
    """Final LayerNorm and (if not tied) the output projection."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.ln_f = _layer_norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.out = _linear(cfg, cfg.d_model, cfg.vocab_size, rngs, use_bias=False)


# --------------------------------------------------------------------------------------
# Pure-dict <-> module
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Def:
    """How to rebuild one module from its pure dict."""

    graphdef: Any  # nnx.GraphDef
    treedef: Any  # jax treedef of the pure dict
    abstract: tuple  # leaf jax.ShapeDtypeStructs, in treedef order

    @property
    def shapes(self) -> tuple:
        return tuple(tuple(a.shape) for a in self.abstract)


@functools.lru_cache(maxsize=64)
def _defs(cfg: GPTConfig) -> dict[str, _Def]:
    defs = {}
    for group, cls in ((EMBED, Embedding), (BLOCKS, Block), (HEAD, Head)):
        module = nnx.eval_shape(lambda cls=cls: cls(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(module, nnx.Param)  # raises if any non-Param state
        pure = nnx.to_pure_dict(state)
        leaves, treedef = jax.tree.flatten(pure)
        abstract = tuple(jax.ShapeDtypeStruct(l.shape, l.dtype) for l in leaves)
        defs[group] = _Def(graphdef, treedef, abstract)
    return defs


def _to_pure(module: nnx.Module) -> dict:
    """A module's parameters as a nested dict (string keys) of plain arrays."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _rebuild(d: _Def, pure: PyTree, what: str) -> nnx.Module:
    leaves, treedef = jax.tree.flatten(pure)
    if treedef != d.treedef:
        raise ValueError(f"parameters of {what} have structure {treedef}, expected {d.treedef}")
    shapes = tuple(tuple(jnp.shape(l)) for l in leaves)
    if shapes != d.shapes:
        raise ValueError(f"parameters of {what} have shapes {shapes}, expected {d.shapes}")
    # nnx.merge accepts a nested dict of raw arrays: leaves are matched to the graphdef's
    # variables in sorted-path order (the same order nnx.split produced) and re-wrapped as
    # nnx.Param. Rebuild a fresh dict so the caller's containers are never aliased.
    return nnx.merge(d.graphdef, jax.tree.unflatten(d.treedef, leaves))


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPT:
    """A GPT bound to a config: init, forward and loss over a :class:`ParamAccess`.

    Hashable and compared by ``cfg``, so ``GPT(cfg).loss`` can be a static argument.
    """

    cfg: GPTConfig

    groups = GROUPS
    stacked_groups = STACKED_GROUPS

    # ---- parameters -------------------------------------------------------------------

    def init_params(self, seed: int | jax.Array = 0) -> dict[str, PyTree]:
        """Fresh parameters ``{"embed", "blocks", "head"}`` as plain arrays.

        ``"blocks"`` stacks ``n_layers`` independently initialised Blocks along axis 0.
        ``seed`` is an int (possibly traced) or a typed PRNG key. Deterministic in ``seed``;
        traceable (works under ``jax.eval_shape`` and ``jax.jit``, e.g. with
        ``out_shardings`` to create the parameters already sharded).
        """
        cfg = self.cfg
        if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
            key = seed
        else:
            key = jax.random.key(seed)  # also accepts a traced int (init under jax.jit)
        rngs = nnx.Rngs(key)
        embed = _to_pure(Embedding(cfg, rngs=rngs))
        layers = [_to_pure(Block(cfg, rngs=rngs)) for _ in range(cfg.n_layers)]
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        head = _to_pure(Head(cfg, rngs=rngs))
        return {EMBED: embed, BLOCKS: blocks, HEAD: head}

    def abstract_params(self) -> dict[str, PyTree]:
        """``jax.ShapeDtypeStruct`` tree of :meth:`init_params` (allocates nothing, and
        traces one module of each kind rather than ``n_layers`` Blocks)."""
        defs = _defs(self.cfg)
        out = {}
        for group, d in defs.items():
            leaves = d.abstract
            if group in STACKED_GROUPS:
                leaves = tuple(jax.ShapeDtypeStruct((self.cfg.n_layers, *a.shape), a.dtype) for a in leaves)
            out[group] = jax.tree.unflatten(d.treedef, leaves)
        return out

    # ---- module views of the pure dicts -------------------------------------------------

    def embedding(self, embed_params: PyTree) -> Embedding:
        return cast(Embedding, _rebuild(_defs(self.cfg)[EMBED], embed_params, f"group {EMBED!r}"))

    def block(self, layer_params: PyTree) -> Block:
        """One layer's Block from its (un-stacked) pure dict."""
        return cast(Block, _rebuild(_defs(self.cfg)[BLOCKS], layer_params, f"one layer of {BLOCKS!r}"))

    def head(self, head_params: PyTree) -> Head:
        return cast(Head, _rebuild(_defs(self.cfg)[HEAD], head_params, f"group {HEAD!r}"))

    # ---- forward ------------------------------------------------------------------------

    def embed(self, p: ParamAccess, inputs_BxL: jax.Array, embedding: Embedding | None = None) -> jax.Array:
        """Token + position embeddings of ``inputs`` ``[B, L]``: rows (``p.take``) with
        ``embed_lookup="take"``, else from ``embedding`` (gathered here if not given)."""
        _check_inputs(self.cfg, inputs_BxL, "inputs")
        if self.cfg.embed_lookup == "take":
            L, dtype = inputs_BxL.shape[-1], self.cfg.compute_dtype
            tok_BxLxD = p.take(f"{EMBED}/tok/embedding", inputs_BxL).astype(dtype)
            return tok_BxLxD + p.take(f"{EMBED}/pos/embedding", jnp.arange(L)).astype(dtype)[None]
        if embedding is None:
            embedding = self.embedding(p.gather(EMBED))
        return embedding(inputs_BxL)

    def trunk(self, p: ParamAccess, x_BxLxD: jax.Array, *, remat: bool = True) -> jax.Array:
        """All blocks, one layer at a time via ``p.scan``."""

        def body(x_BxLxD, layer_params, _):
            return self.block(layer_params)(x_BxLxD), None

        x_BxLxD, _ = p.scan(BLOCKS, body, x_BxLxD, remat=remat)
        return x_BxLxD

    def unembed(self, p: ParamAccess, x_BxLxD: jax.Array, embedding: Embedding | None = None) -> jax.Array:
        """Final norm and output projection; float32 logits. A tied model reads ``embedding``
        (gathered here if not given)."""
        head = self.head(p.gather(HEAD))
        h_BxLxD = head.ln_f(x_BxLxD)
        if self.cfg.tie_embeddings:
            if embedding is None:
                embedding = self.embedding(p.gather(EMBED))
            logits_BxLxV = embedding.attend(h_BxLxD)
        else:
            logits_BxLxV = head.out(h_BxLxD)
        return logits_BxLxV.astype(jnp.float32)

    def logits(self, p: ParamAccess, inputs_BxL: jax.Array, *, remat: bool = True) -> jax.Array:
        """float32 logits ``[B, L, vocab]`` for int ``inputs`` ``[B, L]`` (L <= seq_len).

        With ``embed_lookup="gather"`` a tied embedding is gathered once and used at both ends,
        so its gradient is summed locally and reduce-scattered once; the price is the full table
        held through the trunk and its full gradient through the backward pass. With ``"take"``
        the lookup reads rows and the table is gathered at the output projection alone, its
        gradient reduce-scattered as soon as the backward pass has it; the lookup's gradient
        goes to each device's block (GPT-1.3B on 8 devices: 199-300 MB less peak per device,
        ``docs/results/memory.md``).
        """
        p = _as_access(p)
        held = self.cfg.tie_embeddings and self.cfg.embed_lookup == "gather"
        embedding = self.embedding(p.gather(EMBED)) if held else None
        x_BxLxD = self.embed(p, inputs_BxL, embedding)
        x_BxLxD = self.trunk(p, x_BxLxD, remat=remat)
        return self.unembed(p, x_BxLxD, embedding)

    def loss(self, p: ParamAccess, batch: Mapping[str, jax.Array], *, remat: bool = True) -> jax.Array:
        """Mean next-token cross-entropy (float32 scalar, nats/byte).

        ``batch = {"inputs": int[B, L], "targets": int[B, L]}``; ``targets[b, t]`` is the
        token that follows ``inputs[b, t]``.
        """
        inputs_BxL, targets_BxL = _check_batch(self.cfg, batch)
        logits_BxLxV = self.logits(p, inputs_BxL, remat=remat)
        return cross_entropy(logits_BxLxV, targets_BxL)

    # ---- accounting ---------------------------------------------------------------------

    def count_params(self) -> int:
        return count_params(self.abstract_params())

    def flops_per_token(self) -> float:
        return flops_per_token(self.cfg)


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean token cross-entropy in float32."""
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    nll_BxL = -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return jnp.mean(nll_BxL)


def _as_access(p) -> ParamAccess:
    # Convenience: a plain parameter dict is treated as LocalParams.
    return LocalParams(p) if isinstance(p, dict) else p


def _check_inputs(cfg: GPTConfig, x, name: str) -> None:
    if jnp.ndim(x) != 2:
        raise ValueError(f"{name} must be [batch, length], got shape {jnp.shape(x)}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"{name} must be integer token ids, got {jnp.result_type(x)}")
    if jnp.shape(x)[1] > cfg.seq_len:
        raise ValueError(f"{name} length {jnp.shape(x)[1]} exceeds GPTConfig.seq_len={cfg.seq_len}")


def _check_batch(cfg: GPTConfig, batch) -> tuple[jax.Array, jax.Array]:
    try:
        inputs, targets = batch["inputs"], batch["targets"]
    except (KeyError, TypeError):
        raise ValueError(
            f"batch must be a mapping with 'inputs' and 'targets', got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
        ) from None
    _check_inputs(cfg, inputs, "inputs")
    _check_inputs(cfg, targets, "targets")
    if jnp.shape(inputs) != jnp.shape(targets):
        raise ValueError(f"inputs {jnp.shape(inputs)} and targets {jnp.shape(targets)} differ in shape")
    return inputs, targets


# --------------------------------------------------------------------------------------
# Functional API and accounting
# --------------------------------------------------------------------------------------


def init_params(cfg: GPTConfig, seed: int = 0) -> dict[str, PyTree]:
    """``GPT(cfg).init_params(seed)``."""
    return GPT(cfg).init_params(seed)


def abstract_params(cfg: GPTConfig) -> dict[str, PyTree]:
    """Shape/dtype tree of ``init_params(cfg)``, without allocating (any preset size)."""
    return GPT(cfg).abstract_params()


def loss(cfg: GPTConfig, p: ParamAccess, batch: Mapping[str, jax.Array]) -> jax.Array:
    """``GPT(cfg).loss(p, batch)``."""
    return GPT(cfg).loss(p, batch)


def count_params(params: PyTree) -> int:
    """Total number of parameter elements (works on arrays or ShapeDtypeStructs)."""
    return int(sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(params)))


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward), the standard estimate.

    ``6 * N + 12 * n_layers * d_model * seq_len`` (Kaplan et al. 2020; PaLM, App. B):

    * ``N`` counts the parameters that take part in matmuls: per layer the attention
      projections ``4 * d_model**2`` and the MLP ``2 * d_model * d_ff``, plus the output
      projection ``vocab_size * d_model`` (counted once whether or not it is tied to the
      embedding). Embedding lookups, norms and biases are left out. Each such parameter
      costs 2 FLOPs in the forward matmul and 4 in the backward: ``6 * N``.
    * Attention scores ``QK^T`` and ``AV`` cost ``2 * 2 * seq_len * d_model`` forward per
      token per layer, times 3 for forward + backward: ``12 * n_layers * d_model * seq_len``
      (the full, not the causally halved, matrix, as the XLA kernel computes it).

    Rematerialisation (recomputing the forward in the backward pass) is *not* included:
    this is model FLOPs, the numerator of MFU.
    """
    assert cfg.d_ff is not None  # GPTConfig.__post_init__ fills the default
    n_matmul = cfg.n_layers * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.d_ff)
    n_matmul += cfg.vocab_size * cfg.d_model
    attention = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
    return float(6 * n_matmul + attention)


def small_leaves(params: PyTree, threshold: int = 4096, stacked_groups=STACKED_GROUPS) -> list[str]:
    """'/'-joined paths of leaves with fewer than ``threshold`` elements (per layer for a
    stacked group): norms, biases and similar, which a quantizer may keep at full precision."""
    out = []
    for group, tree in params.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            shape = jnp.shape(leaf)[1:] if group in stacked_groups else jnp.shape(leaf)
            if math.prod(shape) < threshold:
                out.append("/".join([group, *(str(getattr(k, "key", k)) for k in path)]))
    return out
