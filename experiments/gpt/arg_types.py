"""The value types of the trainer's flags (argparse ``type=`` functions): bits (``1..8`` or
``none``), per-leaf bit policies, bounded integers, positive numbers, seeds, seconds. Each raises
``argparse.ArgumentTypeError`` with a message that names what was expected.

Shared by :mod:`experiments.gpt.args` and :mod:`experiments.gpt.cluster_args`; standard library only.
"""

from __future__ import annotations

import argparse
import math


def parse_bits(text: str):
    """Bits per element: an integer 1..8, or ``"none"`` (also ``fp``, ``full``): full precision."""
    if text.strip().lower() in ("none", "fp", "full"):
        return "none"
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer 1..8 or 'none', got {text!r}") from None
    if not 1 <= v <= 8:
        raise argparse.ArgumentTypeError(f"expected an integer 1..8 or 'none', got {v}")
    return v


def parse_bit_policy(text: str) -> tuple:
    """``--bit-policy 'embed*=8,8;blocks/*/kernel=4,none'``: ``;``-separated rules
    ``PATTERN=WEIGHT_BITS,GRAD_BITS`` (bits 1..8 or none) -> ``QSDPConfig.bit_policy``."""
    rules = []
    for i, part in enumerate(p.strip() for p in text.split(";")):
        if not part:
            continue
        pattern, eq, bits = part.rpartition("=")
        values = [b.strip() for b in bits.split(",")]
        if not eq or not pattern.strip() or len(values) != 2:
            raise argparse.ArgumentTypeError(
                f"rule {i + 1} {part!r}: expected PATTERN=WEIGHT_BITS,GRAD_BITS (bits 1..8 or none), "
                "rules separated by ';', e.g. 'embed*=8,8;head*=8,none'"
            )
        try:
            w, g = (None if parse_bits(v) == "none" else parse_bits(v) for v in values)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"rule {i + 1} {part!r}: {e}") from None
        rules.append((pattern.strip(), w, g))
    if not rules:
        raise argparse.ArgumentTypeError(f"no rule in {text!r}: expected e.g. 'embed*=8,8'")
    return tuple(rules)


def int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum`` (``what`` names that in the message)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    return parse


positive_int = int_at_least(1, "a positive integer")
nonnegative_int = int_at_least(0, "an integer >= 0")


def parse_seed(text: str) -> int:
    v = nonnegative_int(text)
    if v >= 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32), got {v}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (``nan``, ``inf``, 0 and negative numbers are refused)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


def parse_seconds(text: str) -> float:
    """``--failure-timeout``: a finite number of seconds > 0 (leave the flag out for no bound)."""
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds > 0, got {text!r} (leave the flag out to turn the watchdog off)"
        ) from None
