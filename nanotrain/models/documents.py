"""Document boundaries inside packed windows, read from the end-of-document token.

Prepared data packs documents back to back, each followed by the end-of-document (EOD) token,
and cuts windows without regard to where documents start. With a `DocumentMask` on the model:

- attention is block-causal: position t attends to s <= t of its own document only;
- rotary positions restart at 0 at the first token of every document;
- with ``mask_loss`` (Megatron's ``--eod-mask-loss``) a label that predicts across a boundary
  is ignored: the EOD position's label (the next document's first token), and for MTP depth
  k every target more than the rest of the document away.

The EOD token belongs to the document it ends; the token after it starts the next one. A
window's first token starts a document (the one cut by the window's start is seen from
there), as in Megatron's ``--reset-position-ids``. Everything is derived from input_ids,
which every tensor- and pipeline-parallel rank holds whole, so no rank communicates for it.

Shapes: B batch, T the whole sequence (all positions; attention sees them all, also under
sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class DocumentMask:
    """Attention and positions stop at `eod_token_id`; `mask_loss` ignores cross-boundary labels.

    Args:
        eod_token_id: the end-of-document id (the tokenizer's EOS, ``metadata["eos_id"]``).
        mask_loss: ignore labels that predict the next document's tokens from this one's.
        mask_attention: block-causal attention and restarting positions (False: only
            `mask_loss` applies, attention spans the whole window).
    Raises:
        ValueError: for a negative or non-int `eod_token_id`.
    """

    eod_token_id: int
    mask_loss: bool = False
    mask_attention: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.eod_token_id, bool) or not isinstance(self.eod_token_id, int):
            raise ValueError(f"eod_token_id must be an int, got {self.eod_token_id!r}")
        if self.eod_token_id < 0:
            raise ValueError(f"eod_token_id must be >= 0, got {self.eod_token_id}")

    def segments(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Document index of every position, counted from 0 in each window: [B, T] int64."""
        is_eod = (input_ids == self.eod_token_id).long()  # (B, T)
        # EODs strictly before t: the EOD itself stays in the document it ends
        return is_eod.cumsum(dim=1) - is_eod

    def positions(self, segments: torch.Tensor) -> torch.Tensor:
        """Position of every token inside its document: [B, T] int64 from `segments` [B, T]."""
        t = segments.shape[1]
        index = torch.arange(t, device=segments.device).expand_as(segments)  # (B, T)
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]  # first token of each document
        # the index of the latest document start at or before t
        start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        return index - start_index

    def attention_mask(self, segments: torch.Tensor) -> torch.Tensor:
        """Block-causal mask [B, 1, T, T] bool (True = may attend): s <= t, same document.

        Every row keeps its diagonal, so no softmax row is empty.
        """
        t = segments.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril_()  # (T, T)
        same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
        return (same & causal)[:, None]  # (B, 1, T, T)

    def labels(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`labels` [B, T] with the EOD positions' labels ignored when `mask_loss` (as is
        otherwise): the label at t is token t + 1, across a boundary exactly where t is EOD."""
        if not self.mask_loss:
            return labels
        return labels.masked_fill(input_ids == self.eod_token_id, IGNORE_INDEX)

    def mtp_targets(self, input_ids: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
        """MTP depth k's targets [B, T]: token t + k + 1 at t (labels shifted left by k, the
        last k ignored), and with `mask_loss` also ignored where an EOD lies in t .. t + k
        (the target is then in a later document than t).

        Args: input_ids, labels [B, T] (labels as given to the model, before `labels`).
        """
        target = shift_left(labels, k, IGNORE_INDEX)
        if not self.mask_loss:
            return target
        is_eod = input_ids == self.eod_token_id  # (B, T)
        crossing = torch.zeros_like(is_eod)
        for j in range(k + 1):  # an EOD at t + j, j = 0 .. k
            crossing |= shift_left(is_eod, j, False)
        return target.masked_fill(crossing, IGNORE_INDEX)


@dataclass
class DocumentView:
    """One forward's document layout: what the decoder layers read.

    Attributes:
        positions: [B, T] int64 rotary position of each token.
        mask: [B, 1, T, T] bool block-causal attention mask (True = may attend).
    """

    positions: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, documents: DocumentMask, input_ids: torch.Tensor) -> DocumentView:
        """The layout of `input_ids` [B, T] under `documents`."""
        segments = documents.segments(input_ids)
        return cls(documents.positions(segments), documents.attention_mask(segments))


def set_document_mask(model: nn.Module, documents: DocumentMask | None) -> None:
    """Make `model` (a `CausalLM`, or a pipeline stage running one) keep attention inside
    each packed document and restart positions there, reading boundaries from `documents`'s
    end-of-document id (None: plain causal attention over the whole window)."""
    models = [m for m in model.modules() if hasattr(m, "attention_inputs")]
    full = getattr(model, "full", None)  # a PipelineStage runs its layers with the model's methods
    if hasattr(full, "attention_inputs"):
        models.append(full)
    for m in models:
        m.documents = documents


def shift_left(x: torch.Tensor, k: int, fill: int | bool) -> torch.Tensor:
    """x[:, t + k] at position t, `fill` in the last k positions. x: [B, T] -> [B, T]."""
    out = x.new_full(x.shape, fill)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def rope_at(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables at each token's position: cos, sin [T, d] and positions [B, T] ->
    (cos, sin) each [B, T, d]."""
    return cos[positions], sin[positions]
