"""Which sequence lengths a layout fits: the same plan priced again at other lengths
(`nanotrain plan` prints it under every plan it shows)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nanotrain.planning.plan import Plan, plan_layout

__all__ = ["SEQ_LENGTHS", "SeqFit", "format_seq_fits", "seq_len_fits"]

#: the lengths reported: pre-training and the two context-extension stages of DeepSeek-V3
SEQ_LENGTHS = (4096, 32768, 131072)

GiB = 2**30


@dataclass(frozen=True)
class SeqFit:
    """One sequence length on a layout.

    Attributes:
        seq_len: tokens per sequence.
        memory: the largest rank's bytes (None when the layout cannot run it).
        fits: whether that is within the GPU's memory.
        reason: why it cannot run (e.g. seq_len not a multiple of 2 * cp), else "".
    """

    seq_len: int
    memory: int | None
    fits: bool
    reason: str = ""


def seq_len_fits(
    config: Any, plan: Plan, lengths: tuple[int, ...] = SEQ_LENGTHS, **plan_kwargs: Any
) -> list[SeqFit]:
    """`plan`'s layout priced at each of `lengths` (and at its own length), with the same
    micro batch and number of sequences per step; `plan_kwargs` as given to `plan_layout`.
    Lengths beyond the model's `max_seq_len` are priced too (the rope tables are built for
    max_seq_len: such a run needs a long-context preset or a rope_scaling override)."""
    out = []
    for seq_len in sorted({*lengths, plan.workload.seq_len}):
        workload = replace(plan.workload, seq_len=seq_len)
        try:
            other = plan_layout(config, plan.layout, workload, plan.gpu, **plan_kwargs)
        except ValueError as err:
            out.append(SeqFit(seq_len, None, False, str(err)))
            continue
        out.append(SeqFit(seq_len, other.largest.memory, other.fits))
    return out


def format_seq_fits(fits: list[SeqFit], max_seq_len: int | None = None) -> str:
    """One line per length ("    32768 tokens: 41.20 GiB, fits") and a last line "fits up to
    N tokens" (the longest length that fits with every shorter one that runs fitting too).
    `max_seq_len`: the model's, to mark the lengths beyond it."""
    lines = ["sequence lengths on this layout (same micro batch and sequences per step):"]
    longest = None
    for f in fits:
        if f.memory is None:
            lines.append(f"  {f.seq_len:>7} tokens: cannot run ({f.reason})")
        else:
            verdict = "fits" if f.fits else "DOES NOT FIT"
            beyond = (
                f" (beyond the model's max_seq_len {max_seq_len})"
                if max_seq_len and f.seq_len > max_seq_len
                else ""
            )
            lines.append(f"  {f.seq_len:>7} tokens: {f.memory / GiB:.2f} GiB, {verdict}{beyond}")
    for f in fits:
        if f.memory is None:
            continue  # a length the layout cannot cut does not end the run of fitting ones
        if not f.fits:
            break
        longest = f.seq_len
    lines.append(
        f"fits up to {longest} tokens" if longest else "fits none of these sequence lengths"
    )
    return "\n".join(lines) + "\n"
