"""Which parts of a Flax NNX module are layer stacks (as ``nnx.split_rngs`` + ``nnx.vmap`` make
them), at the top level and nested anywhere below it.

* **The rule** (:func:`layer_count`): a node is a stack of ``n`` layers when it holds at least
  two parameters, every parameter has at least two dimensions, every variable in it
  (parameters, batch statistics, RNG keys and counts) shares one leading size ``n``, and no
  flax layer in it (``nnx.Linear``, ``nnx.Embed``, the norms) holds a parameter of exactly its
  declared shape.
* **Nested stacks** (:func:`nested_stacks`): below a top-level group that is not a stack
  itself, a sub-module is a stack when it passes the rule *and* a flax layer in it shows the
  extra leading axis (its parameter is ``(n, *declared)``). Deeper down the shape rule alone
  matches too much (four ``(d, d)`` projections share a leading size), so a stack of raw
  ``nnx.Param`` variables is found only when named (``stacked=("trunk/layers",)``).
"""

from __future__ import annotations

from typing import AbstractSet, Any, Sequence

import jax.numpy as jnp
from flax import nnx

Path = tuple
CONTAINERS = (nnx.List, nnx.Dict, list, tuple, dict)


def node_at(model, path: Path):
    """The node at ``path`` in ``model`` (attributes, ``nnx.List`` / ``nnx.Dict`` entries)."""
    node = model
    for k in path:
        node = node[k] if isinstance(node, CONTAINERS) else getattr(node, str(k))
    return node


def under(specs: Sequence[Any], prefix: Path, exclude: Sequence[Path] = ()) -> list:
    """The specs whose path starts with ``prefix`` and with none of ``exclude``."""
    inside = lambda p, q: p[: len(q)] == q  # noqa: E731
    return [s for s in specs if inside(s.path, prefix) and not any(inside(s.path, e) for e in exclude)]


def declared_evidence(node) -> set[int | None]:
    """What flax's own layers in ``node`` say: their parameters' declared shapes against the
    actual ones. ``{None}``: a layer holds exactly its declared shape (not a stack); ``{n}``:
    an extra leading axis of ``n`` (a stack). Empty when ``node`` holds no such layer."""
    if not isinstance(node, nnx.Module):
        return set()
    evidence: set[int | None] = set()
    for _, m in nnx.iter_modules(node):
        for name, declared in _declared_shapes(m).items():
            var = getattr(m, name, None)
            if not isinstance(var, nnx.Variable):
                continue
            shape = tuple(jnp.shape(var.get_raw_value()))
            if shape == declared:
                evidence.add(None)
            elif shape[1:] == declared:
                evidence.add(shape[0])
    return evidence


def _declared_shapes(m) -> dict[str, tuple]:
    if type(m) is nnx.Linear:
        return {"kernel": (m.in_features, m.out_features), "bias": (m.out_features,)}
    if type(m) is nnx.Embed:
        return {"embedding": (m.num_embeddings, m.features)}
    if type(m) in (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm) and isinstance(m.num_features, int):
        return {k: (m.num_features,) for k in ("scale", "bias", "mean", "var")}
    return {}


def layer_count(params: list, others: list, evidence: AbstractSet[int | None] = frozenset()) -> int | None:
    """The layer count if these variables look like a layer stack (see the module docstring)."""
    if None in evidence or len(evidence) > 1:
        return None
    if len(params) < 2 or any(len(s.shape) < 2 for s in params):
        return None
    if any(len(s.shape) < 1 for s in others):
        return None
    leading = {s.shape[0] for s in params + others}
    return leading.pop() if len(leading) == 1 else None


def nested_candidates(pspecs: Sequence[Any], top: Sequence[Path]) -> list[Path]:
    """Every node strictly between a top-level group and a parameter, shallowest first."""
    out: set[Path] = set()
    for s in pspecs:
        for t in top:
            if s.path[: len(t)] == t:
                out.update(s.path[:k] for k in range(len(t) + 1, len(s.path)))
    return sorted(out, key=lambda p: (len(p), [str(k) for k in p]))


def nested_stacks(model, pspecs, ospecs, top: Sequence[Path], named: AbstractSet[Path] | None) -> list[Path]:
    """The stacks nested below the top-level groups ``top`` (none of them a stack): those in
    ``named`` when given (the user's ``stacked=``), else those the rule finds with flax's
    evidence (module docstring). The outermost one on each branch; no stack inside another."""
    found: list[Path] = []
    for c in nested_candidates(pspecs, top):
        if any(c[: len(f)] == f for f in found):
            continue
        if named is not None:
            if c in named:
                found.append(c)
            continue
        node = node_at(model, c)
        evidence = declared_evidence(node)
        if not isinstance(node, nnx.Module) or len(evidence) != 1 or None in evidence:
            continue
        if layer_count(under(pspecs, c), under(ospecs, c), evidence) is not None:
            found.append(c)
    return found


def nested_entries(model, pspecs: Sequence[Any], top: Sequence[Path], stacks: Sequence[Path]) -> list[Path]:
    """The entries of the ``nnx.List`` / ``nnx.Dict`` containers nested below the top-level
    groups ``top`` (none of them a stack), outside the nested ``stacks``: each is a group of its
    own, gathered for its own call, as the entries of a top-level container are (a model's
    ``self.trunk.layers`` list was one group, gathered whole for every call of any block)."""
    found: list[Path] = []
    for c in nested_candidates(pspecs, top):
        if any(c[: len(s)] == s for s in stacks) or not isinstance(node_at(model, c), CONTAINERS):
            continue
        for s in pspecs:
            if s.path[: len(c)] == c and len(s.path) > len(c) + 1 and s.path[: len(c) + 1] not in found:
                found.append(s.path[: len(c) + 1])
    return found
