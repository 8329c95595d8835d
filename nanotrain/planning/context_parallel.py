"""Context parallelism priced: what `MegatronStrategy(cp=N)` adds to a rank's memory, traffic
and time.

The runtime (`nanotrain.parallel.context`): each sequence is cut into 2N chunks and cp rank i
holds chunks i and 2N-1-i (so every rank gets the same share of the causal attention work);
attention all-gathers the keys and values of the whole sequence over the cp group (MLA: the
compressed latent c_KV of `kv_lora_rank` plus the shared rope key of `qk_rope_head_dim` per
token, expanded to heads on each rank; dense MHA/GQA: K and V of the kv heads), and the
backward reduce-scatters their gradients. The exchange is not overlapped with compute.

How the planner uses it (`nanotrain.planning.plan.plan_layout`):

* `fold_cp`: for parameters, gradients, ZeRO and experts a cp rank is one more data-parallel
  rank (gradients reduce and ZeRO shards over dp x cp; ep groups are drawn from dp x cp in
  the mesh order tp, cp, dp, pp), and for every per-token quantity (activations, tp / sp,
  ep and pp traffic) it holds seq_len / cp tokens of each sequence. So the layout is priced
  as dp x cp data-parallel ranks training sequences of seq_len / cp tokens, except the
  attention FLOPs, which stay those of the whole sequence (`stage_flops` is given the real
  sequence length).
* `cp_traffic`: per microbatch and attention layer one all-gather in the forward (again in
  a recomputed forward that rebuilds attention: recompute "full" / "selective") and one
  reduce-scatter in the backward; blocking, at the cp group's link (`cp_link`).
* `cp_activation_bytes`: the whole-sequence tensors a cp rank keeps on top of its own
  seq_len / cp tokens (see there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nanotrain.planning.layout import PlanLayout, Workload

__all__ = [
    "CpActivations",
    "cp_activation_bytes",
    "cp_layer_exchange_bytes",
    "cp_link",
    "cp_traffic",
    "exchange_width",
    "fold_cp",
]

#: recompute modes whose rebuilt forward runs the attention core again (and so gathers again)
REGATHER = ("full", "selective")


def _is_mla(config: Any) -> bool:
    return hasattr(config, "kv_lora_rank")


def check_seq_len(seq_len: int, cp: int) -> None:
    """Refuse a sequence that does not cut into 2 * cp equal chunks.

    Raises:
        ValueError: cp < 1, or seq_len not a multiple of 2 * cp.
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be an int >= 1, got {cp!r}")
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism cuts each sequence into 2*cp={2 * cp} chunks: "
            f"seq_len={seq_len} is not a multiple of it; pick a seq_len that is, or another cp"
        )


def exchange_width(config: Any, tp: int = 1) -> int:
    """Elements per token that one rank of a tp group all-gathers over cp.

    MLA: ``kv_lora_rank + qk_rope_head_dim`` (the latent and the rope key come from the
    replicated down-projection, so every tp rank gathers them whole); dense: K and V of this
    rank's kv heads, ``2 * (num_kv_heads / tp) * head_dim``.
    """
    if _is_mla(config):
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * max(config.num_kv_heads // tp, 1) * config.head_dim


def cp_layer_exchange_bytes(
    config: Any, seq_len: int, cp: int, element_bytes: int
) -> tuple[int, int]:
    """Bytes one cp rank receives per attention layer for one sequence of `seq_len` tokens
    (tp = 1): (forward all-gather, backward reduce-scatter).

    The forward gathers the other cp - 1 ranks' seq_len / cp tokens of `exchange_width`
    elements; the backward reduce-scatters the gradient of the gathered buffer, in which each
    rank receives the other ranks' contributions to its own seq_len / cp tokens: the same
    bytes.

    Raises:
        ValueError: cp < 1, or seq_len not a multiple of 2 * cp.
    """
    check_seq_len(seq_len, cp)
    received = (cp - 1) * (seq_len // cp) * exchange_width(config) * element_bytes
    return received, received


def fold_cp(layout: PlanLayout, workload: Workload) -> tuple[PlanLayout, Workload]:
    """The layout and workload the rest of the planner prices (module docstring): cp folded
    into dp (dp x cp ranks), each sequence's seq_len / cp tokens as a sequence of its own
    (cp times as many of them, so the microbatches per replica and the tokens per step stay).
    Unchanged when cp = 1.

    Raises:
        ValueError: seq_len not a multiple of 2 * cp.
    """
    if layout.cp == 1:
        return layout, workload
    check_seq_len(workload.seq_len, layout.cp)
    folded = replace(layout, dp=layout.dp * layout.cp, cp=1)
    local = replace(
        workload,
        seq_len=workload.seq_len // layout.cp,
        global_batch_size=workload.global_batch_size * layout.cp,
    )
    return folded, local


def _attention_layers(config: Any, chunks: list[list[int]], last: bool) -> list[int]:
    """Each attention layer's position within its chunk (recompute modes go by position),
    plus the MTP modules' blocks (position -1: no recompute) on the last stage."""
    positions = [i for chunk in chunks for i in range(len(chunk))]
    return positions + ([-1] * getattr(config, "mtp_depth", 0) if last else [])


def _mode(layout: PlanLayout, position: int) -> str | None:
    return None if position < 0 else layout.layer_recompute(position)


def cp_traffic(
    config: Any,
    layout: PlanLayout,
    workload: Workload,
    chunks: list[list[int]],
    last: bool,
    element_bytes: int,
) -> tuple[float, int]:
    """(bytes, collective calls) one rank of a pipeline stage exchanges over its cp group per
    optimizer step: per microbatch and attention layer (`chunks`' decoder layers, plus the
    MTP blocks when `last`) one all-gather and one reduce-scatter of
    `cp_layer_exchange_bytes` for micro_batch_size sequences at this tp rank's width, and one
    more all-gather where the layer's recompute mode rebuilds attention (`REGATHER`).
    (0, 0) when cp = 1."""
    if layout.cp == 1:
        return 0.0, 0
    check_seq_len(workload.seq_len, layout.cp)
    per_token = exchange_width(config, layout.tp) * element_bytes
    one = (layout.cp - 1) * (workload.seq_len // layout.cp) * workload.micro_batch_size
    calls = sum(2 + (_mode(layout, p) in REGATHER) for p in _attention_layers(config, chunks, last))
    micro = workload.num_microbatches(layout)
    return float(micro * calls * one * per_token), micro * calls


def cp_link(layout: PlanLayout, gpu: Any, latency: tuple[float, float]) -> tuple[float, float]:
    """(bytes/s, seconds per call) of the cp group's ring: the mesh places a cp group's ranks
    tp apart (tp innermost, then cp), so it stays on one node when tp * cp <= GPUs per node
    (NVLink-class `intra_node_bw`), else it crosses nodes at `inter_node_bw`. `latency`:
    (intra-node, inter-node) seconds per collective."""
    if layout.tp * layout.cp <= gpu.gpus_per_node:
        return gpu.intra_node_bw, latency[0]
    return gpu.inter_node_bw, latency[1]


@dataclass(frozen=True)
class CpActivations:
    """Whole-sequence bytes a cp rank holds beyond its own seq_len / cp tokens.

    Attributes:
        per_microbatch_chunk: saved for backward, per microbatch, per local chunk.
        transient: one layer's whole-sequence buffers rebuilt during its backward under a
            recompute mode that drops them (0 when none does).
    """

    per_microbatch_chunk: list[int]
    transient: int


def _layer_bytes(config: Any, layout: PlanLayout, workload: Workload, g: int) -> tuple[int, int]:
    """(gathered, expanded) bytes of one layer for the whole microbatch's sequence, beyond
    what the rank's own tokens already count: the gathered buffer (MLA: latent + rope key;
    dense: K and V of the kv heads, which the attention kernel saves as they are) and, for
    MLA, the keys and kv_b output of every head (q_nope / rope concatenated keys, values)
    the kernel saves for the whole sequence."""
    b, s, cp = workload.micro_batch_size, workload.seq_len, layout.cp
    others = b * (s - s // cp)  # tokens of the other cp ranks
    gathered = others * exchange_width(config, layout.tp) * g
    if not _is_mla(config):
        return gathered, 0
    heads = config.num_heads // layout.tp
    per_head = config.qk_head_dim + config.qk_nope_head_dim + config.v_head_dim
    return gathered, others * heads * per_head * g


def cp_activation_bytes(
    config: Any,
    layout: PlanLayout,
    workload: Workload,
    chunks: list[list[int]],
    last: bool,
    element_bytes: int,
) -> CpActivations:
    """What the gathered context adds to a rank's activations (`CpActivations`), per layer
    by its recompute mode:

    * none: the gathered buffer and (MLA) the expanded keys and values of the other ranks'
      tokens are saved (`_layer_bytes`);
    * "light" (MLA's up-projections rebuilt): the gathered latent is saved, the expansion
      is rebuilt in backward (transient);
    * "full" / "selective": nothing is saved; the layer's backward rebuilds both (transient).

    The MTP blocks on the last stage count as layers without recomputation.
    """
    if layout.cp == 1:
        return CpActivations([0] * len(chunks), 0)
    gathered, expanded = _layer_bytes(config, layout, workload, element_bytes)
    saved, transient = [], 0
    for index, chunk in enumerate(chunks):
        positions = list(range(len(chunk)))
        if last and index == len(chunks) - 1:
            positions += [-1] * getattr(config, "mtp_depth", 0)
        total = 0
        for p in positions:
            mode = _mode(layout, p)
            if mode is None:
                total += gathered + expanded
            elif mode == "light" and _is_mla(config):
                total += gathered
                transient = max(transient, expanded)
            elif mode == "light":  # dense attention keeps its K and V under "light"
                total += gathered
            else:
                transient = max(transient, gathered + expanded)
        saved.append(total)
    return CpActivations(saved, transient)


#: fewest tokens of each sequence a cp rank keeps in a search: below it the gathers cost more
#: than the memory they save (Llama 3's CP16 at 131,072 tokens keeps 8,192)
MIN_TOKENS_PER_CP_RANK = 4096


def search_cp_sizes(ranks: int, seq_len: int) -> list[int]:
    """cp sizes a layout search tries for `ranks` data-parallel-or-cp ranks: 1, and every
    divisor of `ranks` that cuts seq_len into 2 * cp whole chunks while leaving each rank
    at least `MIN_TOKENS_PER_CP_RANK` tokens."""
    return [
        cp
        for cp in range(1, ranks + 1)
        if ranks % cp == 0
        and (cp == 1 or (seq_len % (2 * cp) == 0 and seq_len // cp >= MIN_TOKENS_PER_CP_RANK))
    ]
