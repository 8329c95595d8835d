"""Activation memory: the bytes a rank's forward saves for backward, per microbatch and at the
pipeline schedule's worst moment.

The bytes of each part (decoder layers, embedding, head and loss, MTP) come from the formulas
of `nanotrain.planning.activation_layers`, which follow what OUR forward code saves (see its
docstring for the notation, the dtypes of each precision and the sources). This module adds
them up per pipeline chunk and applies the schedule term of Megatron-LM (Narayanan et al.
2021): a rank holds the activations of the microbatches its schedule has forwarded but not yet
backpropagated, taken here from the code's own schedule (`PlanLayout.schedule_actions`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from nanotrain.planning.activation_layers import (
    F32,
    Dims,
    Ledger,
    decoder_layer,
    dtypes_for,
    embedding,
    head_and_loss,
    mtp_block,
    saves_rope_tables,
)
from nanotrain.planning.kept import kept
from nanotrain.planning.layout import PlanLayout, Workload, pipeline_actions
from nanotrain.planning.rank_model import config_key

__all__ = ["ActivationEstimate", "activation_estimate", "layer_activation_bytes"]


@dataclass(frozen=True)
class ActivationEstimate:
    """Saved-for-backward activation bytes of one pipeline rank.

    Attributes:
        per_microbatch_chunk: bytes one microbatch saves through each local chunk of the rank
            (its layers, plus the embedding on virtual stage 0 and the head, loss and MTP on
            the last virtual stage).
        in_flight: most (microbatch, chunk) forwards alive at once (`PlanLayout.in_flight`).
        saved_peak: most bytes of saved activations alive at once over the schedule
            (forwards add a chunk's bytes, backwards free them, in the schedule's own order;
            weight copies made once per step count once).
        transient: bytes that recomputation rebuilds during one layer's backward on top of
            `saved_peak` (0 without recomputation).
        peak: saved_peak + transient, the activation term of the rank's memory peak.
        detail: bytes per part for ONE microbatch through all local chunks ("norms",
            "attention", "mlp", "moe", "recompute_inputs", "weight_copies", "rope",
            "embedding", "logits", "mtp").
    """

    per_microbatch_chunk: list[int]
    in_flight: int
    peak: int
    detail: dict[str, int]
    saved_peak: int = 0
    transient: int = 0
    chunks: list[list[int]] = field(default_factory=list)

    @property
    def per_microbatch(self) -> int:
        """Bytes one microbatch saves through all local chunks."""
        return sum(self.per_microbatch_chunk)


def layer_activation_bytes(
    config: Any,
    layer_idx: int,
    layout: PlanLayout,
    workload: Workload,
    device: str = "cuda",
) -> dict[str, int]:
    """Bytes per part that one microbatch saves through decoder layer `layer_idx`."""
    d = _dims(layout, workload, device)
    moe = bool(getattr(config, "is_moe_layer", lambda i: False)(layer_idx))
    dt = dtypes_for(workload.precision, layout.fp8_expert_activations)
    led, _ = decoder_layer(config, moe, d, dt, layout.ep, layout.recompute)
    return dict(led)


def _dims(layout: PlanLayout, workload: Workload, device: str) -> Dims:
    sp = layout.sequence_parallel and layout.tp > 1
    if sp and workload.seq_len % layout.tp:
        raise ValueError(
            f"sequence parallelism splits seq_len={workload.seq_len} over tp={layout.tp}; "
            "use a seq_len that is a multiple of tp or turn sequence_parallel off"
        )
    kernel = "math" if device == "cpu" else "fused"
    return Dims(workload.micro_batch_size, workload.seq_len, layout.tp, sp, kernel)


_CACHE: dict[tuple, tuple[Ledger, int]] = {}


def _chunk(
    config: Any,
    layers: tuple[int, ...],
    first: bool,
    last: bool,
    d: Dims,
    precision: str,
    ep: int,
    recompute: str | None,
    modes: tuple[str | None, ...],
    fp8_experts: bool,
) -> tuple[Ledger, int]:
    """(bytes per part of one microbatch through one chunk, its largest transient); `modes`:
    each layer's recompute mode, `recompute` the head's and MTP's; `fp8_experts`: the routed
    experts' saves in fp8."""
    key = (config_key(config), layers, first, last, d, precision, ep, recompute, modes)
    key += (fp8_experts,)
    if key in _CACHE:
        return _CACHE[key]
    dt = dtypes_for(precision, fp8_experts)
    led, transient = Ledger(), 0
    rope_dim = getattr(config, "qk_rope_head_dim", None) or getattr(config, "head_dim", 0)
    if first:
        embedding(led, d, "embedding")
    # layers of one kind save the same: each kind's bytes times its layers (the parts in
    # the order the layers first give them, as layer by layer)
    kinds: dict[tuple[bool, str | None], int] = {}
    for i, mode in zip(layers, modes, strict=True):
        kind = (bool(getattr(config, "is_moe_layer", lambda _: False)(i)), mode)
        kinds[kind] = kinds.get(kind, 0) + 1
    for (moe, mode), count in kinds.items():
        part_bytes, rebuilt = _layer(config, moe, d, dt, precision, fp8_experts, ep, mode)
        for part, nbytes in part_bytes.items():
            led.add(part, count * int(nbytes))
        transient = max(transient, rebuilt)
    if layers and any(saves_rope_tables(config, dt, mode) for mode in modes):
        led.add("rope", 2 * d.s * (rope_dim // 2) * F32)  # the chunk's cos / sin tables
    if last:
        transient = max(transient, head_and_loss(led, config, d, dt, "logits", recompute))
        for _ in range(getattr(config, "mtp_depth", 0)):
            transient = max(transient, mtp_block(led, config, d, dt, ep, recompute))
    if len(_CACHE) > 4096:
        _CACHE.clear()
    _CACHE[key] = (led, transient)
    return led, transient


def _layer(
    config: Any,
    moe: bool,
    d: Dims,
    dt: Any,
    precision: str,
    fp8_experts: bool,
    ep: int,
    mode: str | None,
) -> tuple[Ledger, int]:
    """`decoder_layer` (`dt`: the dtypes of `precision` and `fp8_experts`), kept per shape:
    the chunks of a search's layouts hold the same few kinds of layers."""
    key = (config_key(config), moe, d, precision, fp8_experts, ep, mode)
    return kept(_LAYERS, key, lambda: decoder_layer(config, moe, d, dt, ep, mode), 16384)


_LAYERS: dict[tuple, tuple[Ledger, int]] = {}


def activation_estimate(
    config: Any,
    layout: PlanLayout,
    workload: Workload,
    pp_rank: int = 0,
    *,
    device: str = "cuda",
) -> ActivationEstimate:
    """Activation bytes of pipeline rank `pp_rank` of `layout` training `workload`.

    Args:
        config: a DenseConfig or DeepSeekConfig.
        layout, workload: the plan (see `PlanLayout`, `Workload`).
        pp_rank: the pipeline rank (every tp / dp / ep rank of a stage saves the same).
        device: "cuda" (flash / memory-efficient attention saves q, k, v, out and the
            log-sum-exp) or "cpu" (torch's math kernel for MLA, whose q/k and v head dims
            differ, saves the fp32 [s, s] probabilities).

    Raises:
        ValueError: for a pp_rank outside the layout, or a sequence that sequence
            parallelism cannot split.
    """
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, {layout.pp}) for {layout.describe()}")
    d = _dims(layout, workload, device)
    if layout.pp > 1:
        chunks = layout.stage_chunks(config, pp_rank)
    else:
        chunks = [list(range(config.num_layers))]
    num_virtual = layout.pp * len(chunks)
    per_chunk, detail, transient, copies = [], Ledger(), 0, []
    for c, layers in enumerate(chunks):
        virtual = layout.placement.stage(pp_rank, c) if layout.pp > 1 else 0
        led, rebuilt = _chunk(
            config,
            tuple(layers),
            virtual == 0,
            virtual == num_virtual - 1,
            d,
            workload.precision,
            layout.ep,
            layout.recompute,
            tuple(layout.chunk_recomputes(layers)),
            layout.fp8_expert_activations,
        )
        per_chunk.append(sum(led.values()))
        copies.append(led.get("weight_copies", 0))
        for part, nbytes in led.items():
            detail.add(part, nbytes)
        transient = max(transient, rebuilt)
    num_microbatches = workload.num_microbatches(layout)
    if not dtypes_for(workload.precision).copies_per_step:
        copies = [0] * len(copies)
    # weight copies made once per step: every chunk's once, the rest per microbatch in flight
    saved = [c - w for c, w in zip(per_chunk, copies, strict=True)]
    saved_peak = _schedule_peak(layout, num_microbatches, pp_rank, saved) + sum(copies)
    return ActivationEstimate(
        per_microbatch_chunk=per_chunk,
        in_flight=layout.in_flight(num_microbatches, pp_rank),
        peak=saved_peak + transient,
        detail=dict(detail),
        saved_peak=saved_peak,
        transient=transient,
        chunks=[list(c) for c in chunks],
    )


def _schedule_peak(
    layout: PlanLayout, num_microbatches: int, pp_rank: int, per_chunk: list[int]
) -> int:
    """Most saved bytes alive at once: walk the schedule's forwards (add that chunk's bytes)
    and backwards (free them). Without a pipeline, gradient accumulation frees each
    microbatch before the next: one microbatch through the whole model."""
    if layout.pp == 1:
        return sum(per_chunk)
    shape = (layout.schedule, num_microbatches, layout.pp, pp_rank, layout.virtual_pp)
    # the same walk, summed per distinct count of live forwards per chunk (exact); with no
    # negative bytes only the counts that no other count reaches in every chunk can peak
    counts = _top_counts(*shape) if min(per_chunk, default=0) >= 0 else _live_counts(*shape)
    return max(sum(n * b for n, b in zip(c, per_chunk, strict=False)) for c in counts)


@functools.lru_cache(maxsize=4096)
def _live_counts(
    schedule: str | None, m: int, pp: int, pp_rank: int, v: int
) -> tuple[tuple[int, ...], ...]:
    """Every distinct (live forwards of chunk 0, of chunk 1, ...) the rank's actions pass
    through, the empty start included: the peak of any per-chunk bytes is at one of them."""
    live = [0] * v
    seen = {tuple(live)}
    for action in pipeline_actions(schedule, m, pp, pp_rank, v):
        live[action.chunk] += 1 if action.kind == "F" else -int(action.frees_activations)
        seen.add(tuple(live))
    return tuple(sorted(seen))


@functools.lru_cache(maxsize=4096)
def _top_counts(
    schedule: str | None, m: int, pp: int, pp_rank: int, v: int
) -> tuple[tuple[int, ...], ...]:
    """`_live_counts` less every count that another reaches or passes in every chunk (with
    bytes >= 0 per chunk such a count never holds more than that other one)."""
    counts = _live_counts(schedule, m, pp, pp_rank, v)
    return tuple(
        c
        for c in counts
        if not any(o != c and all(x >= y for x, y in zip(o, c, strict=True)) for o in counts)
    )
