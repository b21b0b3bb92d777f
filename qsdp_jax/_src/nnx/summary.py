"""What an NNX train step gathers, told to the user: the warning for a layer stack gathered whole,
and the table of ``TrainStep.summary(state, batch)``.

Both read the step's ``record`` (``{group name: "whole" | "per layer" | "per call" | "rows"}``), which the loss fills
while it is traced (:mod:`qsdp_jax._src.nnx.scan`); a group the loss never read is ``"not read"``.
"""

from __future__ import annotations

import warnings


def warn_whole(stacked, record: dict[str, str]) -> None:
    """Warn about the layer stacks among ``stacked`` that the traced step gathered whole.

    Called from the step's trace (``TrainStep._step``): the warning points at its caller.
    """
    whole = [n for n in stacked if record.get(n) == "whole"]
    if whole:
        warnings.warn(
            f"layer stack(s) {whole} are gathered whole (all layers at once), not one layer at "
            "a time: scan them with qsdp_jax.nnx.scan in the forward to keep FSDP's memory "
            "saving (step.summary(state, batch) gives the cost)",
            stacklevel=3,
        )


def summary_table(layout, record: dict[str, str], config) -> str:
    """The text of ``TrainStep.summary``: per group of ``layout``, its layer count, how the
    traced step gathered it (``record``) and the float32 bytes of gathered weights it holds at
    once (a note when a whole stack costs more than one layer), then the total per device (the
    groups held to the backward pass, plus the two largest gathered per call); with
    ``config.bit_policy``, the bits of every sharded leaf."""
    rows = [f"{'group':<16}{'layers':>7}  {'gathered':<11}{'held at once':>14}  note"]
    held_to_backward, per_call = 0, []
    for g in layout.groups:
        how = record.get(g.name, "not read")
        per_layer = 0 if how == "rows" else 4 * g.held_size  # the fp32 gather buffers of one layer
        held = per_layer * (g.n_layers if (g.stacked and how == "whole") else 1)
        note = ""
        if g.stacked and how == "whole":
            note = f"whole stack: {_mib(held)} instead of {_mib(per_layer)} per layer (scan it with qsdp_jax.nnx.scan)"
        if how == "per call":
            note = "gathered for its call and again in the backward pass"
            per_call.append(held)
        elif how == "rows":
            note = "never gathered: its lookups read rows (take_embeddings)"
        elif how != "not read":
            held_to_backward += held
        rows.append(f"{g.name:<16}{g.n_layers:>7}  {how:<11}{_mib(held):>14}  {note}")
    # a resharded call's gather may start while the previous call runs: two at once
    peak = held_to_backward + sum(sorted(per_call)[-2:])
    rows.append(f"gathered weights held at once, at most: {_mib(peak)} per device")
    if config.bit_policy:  # the bits of every sharded leaf
        rows += ["", f"bit policy {config.bit_policy}:", layout.bits_table(config)]
    return "\n".join(rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"
