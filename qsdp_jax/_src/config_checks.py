"""Field checks of :class:`qsdp_jax.config.QSDPConfig`: each failure is a ``ValueError`` that
names the field, the value it got and what is allowed."""

from __future__ import annotations

from typing import NoReturn


def fail(field: str, value, allowed: str) -> NoReturn:
    raise ValueError(f"QSDPConfig.{field}={value!r} is invalid: must be {allowed}")


def check_int(field: str, value, *, minimum: int):
    if isinstance(value, bool) or not isinstance(value, int):
        fail(field, value, f"an integer >= {minimum}")
    if value < minimum:
        fail(field, value, f"an integer >= {minimum}")


def check_bits(field: str, value):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
        fail(field, value, "None (full precision) or an integer in 1..8")


def check_choice(field: str, value, choices):
    if value not in choices:
        fail(field, value, f"one of {', '.join(repr(c) for c in choices)}")
