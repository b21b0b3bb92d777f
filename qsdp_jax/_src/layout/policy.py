"""Per-leaf bit policies (``QSDPConfig.bit_policy``): which bits each sharded leaf gets.

**Paths.** A leaf's path is its group's name and its keys inside the group joined by ``"/"``:
``{"embed": {"tok": w}}`` gives ``"embed/tok"``; a list entry is its index (``"blocks/0/w"``);
a Flax NNX model's groups (``qsdp_jax.nnx``) give e.g. ``"embed/tok/embedding"`` or
``"blocks/attn/qkv/kernel"``. ``ParamLayout.leaf_paths()`` lists them for a model.

**Patterns.** Shell-style, case-sensitive (``fnmatch.fnmatchcase``) on the whole path: ``*``
matches any characters, ``/`` included (``"embed*"`` is the whole ``embed`` group, ``"*kernel"``
every kernel), ``?`` one character, ``[seq]`` one of a set. Rules are tried in order; the first
that matches gives the leaf its ``(weight_bits, grad_bits)``; a leaf no rule matches keeps the
config's ``weight_bits`` / ``grad_bits``. Only sharded leaves (float, at least
``min_shard_size`` elements per layer) are quantized: the small replicated leaves stay full
precision whatever the policy, and a rule that matches no sharded leaf is an error when the
layout is built (:func:`check_rules_match`), naming the rule and the paths there are.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Sequence

import jax

Bits = tuple  # (weight_bits, grad_bits), each None or 1..8


def path_str(group: str, keypath: Sequence[Any]) -> str:
    """``"group/key/key"`` from a group name and a JAX key path inside the group."""
    return "/".join([group, keys_str(keypath)]) if keypath else group


def keys_str(keypath: Sequence[Any]) -> str:
    """``"a/0/b"`` from a JAX key path (dict keys, sequence indices, attribute names)."""
    parts = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


def tree_weight_bits(params, config) -> list:
    """Weight bits of every leaf of a whole parameter tree (``{group: subtree}``, paths as in
    the layout) under ``config.bit_policy``: a rule's, else ``config.weight_bits``. For the
    optimizer used on its own (one device, no flat layout)."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        bits = leaf_bits(config.bit_policy, keys_str(path))
        out.append(config.weight_bits if bits is None else bits[0])
    return out


def tree_paths(group: str, tree) -> list[str]:
    """The path of every leaf of ``tree`` (a group's pytree), in ``tree_flatten`` order."""
    return [path_str(group, kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def first_match(policy: Sequence[tuple], path: str) -> int | None:
    """Index of the first rule of ``policy`` whose pattern matches ``path``, or None."""
    for i, (pattern, _, _) in enumerate(policy):
        if fnmatch.fnmatchcase(path, pattern):
            return i
    return None


def leaf_bits(policy: Sequence[tuple], path: str) -> Bits | None:
    """``(weight_bits, grad_bits)`` of the first matching rule, or None (the config's bits)."""
    i = first_match(policy, path)
    return None if i is None else (policy[i][1], policy[i][2])


def check_rules_match(policy: Sequence[tuple], sharded: Sequence[str], replicated: Sequence[str]) -> None:
    """``ValueError`` naming the first rule that matches none of the ``sharded`` leaf paths
    (saying so when it matches only ``replicated`` ones), with the sharded paths listed."""
    for i, rule in enumerate(policy):
        if any(fnmatch.fnmatchcase(p, rule[0]) for p in sharded):
            continue
        small = [p for p in replicated if fnmatch.fnmatchcase(p, rule[0])]
        why = (
            f"it matches only replicated leaves {small[:5]}, which stay full precision and are "
            "never quantized (fewer than min_shard_size elements, or not float), so it "
            "counts as matching nothing"
            if small
            else "it matches no leaf"
        )
        listed = ", ".join(sharded[:40]) + (f", ... ({len(sharded)} in all)" if len(sharded) > 40 else "")
        raise ValueError(
            f"QSDPConfig.bit_policy[{i}]={tuple(rule)!r} matches no sharded leaf: {why}. Patterns "
            f"are fnmatch on 'group/key/...' paths ('*' crosses '/'); the sharded leaves are: "
            f"{listed or '(none)'}"
        )


def bits_label(bits: Bits) -> str:
    """``W8G8``, ``WFG4`` (F: full precision, the config's fp_comm_dtype)."""
    fmt = lambda b: "F" if b is None else str(b)  # noqa: E731
    return f"W{fmt(bits[0])}G{fmt(bits[1])}"


def buffer_key(group: str, bits: Bits | None) -> str:
    """The key of a gather buffer: the group's name for the config's bits,
    ``"group@W8G8"`` for a policy's."""
    return group if bits is None else f"{group}@{bits_label(bits)}"


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one sharded leaf's local block lives in its group's flat gather buffer (per layer)."""

    index: int  # position among the group's leaves (treedef order)
    shape: tuple[int, ...]  # per-layer shape of one device's block
    dtype: str
    offset: int  # in one device's chunk
    size: int  # elements of the block


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One flat buffer of a group: the group's sharded leaves that share one (weight_bits,
    grad_bits). Without a bit policy every group has one, keyed by the group's name."""

    key: str  # the group's name, or "group@W8G8" (qsdp_jax._src.layout.policy)
    group: str
    index: int  # 0: the buffer at the config's bits; 1, 2, ...: a policy's, in key order
    bits: tuple | None  # (weight_bits, grad_bits) from the bit policy; None: the config's
    slots: tuple  # of Slot, one per leaf, in one device's chunk
    flat_size: int  # the gathered buffer's length (per layer): num_shards * chunk
    chunk: int  # one device's packed length (per layer): its blocks, each padded to whole buckets
    stacked: bool
    n_layers: int

    @property
    def name(self) -> str:
        return self.key

    @property
    def real_size(self) -> int:
        return sum(s.size for s in self.slots)

    def resolved_bits(self, config) -> tuple:
        """``(weight_bits, grad_bits)`` of this buffer under ``config`` (its own, or the config's)."""
        return (config.weight_bits, config.grad_bits) if self.bits is None else self.bits


def bits_table(layout, config=None) -> str:
    """The bits of every sharded leaf of a ``ParamLayout``, buffer by buffer: the summary of a
    ``QSDPConfig.bit_policy``. With ``config`` the config's bits are written out, else shown
    as ``config``; ``fp``: full precision (the config's ``fp_comm_dtype``)."""
    rows = [f"{'leaf':<40}{'buffer':<22}{'weight':>8}{'grad':>8}{'elements':>11}"]
    fmt = lambda b: "fp" if b is None else str(b)  # noqa: E731
    for g in layout.groups:
        paths = g.leaf_paths()
        sizes = [math.prod(x.shape) for x in g.leaves]
        for b in g.buffers:
            if b.bits is None and config is None:
                w = gr = "config"
            else:
                w, gr = map(fmt, b.resolved_bits(config) if b.bits is None else b.bits)
            for s in b.slots:
                rows.append(f"{paths[s.index]:<40}{b.key:<22}{w:>8}{gr:>8}{sizes[s.index]:>11}")
    return "\n".join(rows)
