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
* `cp_extra_flops`: compute the runtime does beyond the model's FLOPs: the attention kernel
  takes an explicit [seq_len / cp, seq_len] mask, so it computes the masked-out half of the
  scores too, and MLA expands the gathered latent (`kv_b_proj`) for every token of the
  sequence on every cp rank, not only for its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from nanotrain.planning.activation_parts import dtypes_for
from nanotrain.strategies.megatron_options import check_context_config

if TYPE_CHECKING:  # layout.py imports this module
    from nanotrain.planning.activations import ActivationEstimate
    from nanotrain.planning.communication import CommEstimate
    from nanotrain.planning.layout import PlanLayout, Workload

__all__ = [
    "CpActivations",
    "add_cp_activations",
    "add_cp_traffic",
    "check_seq_len",
    "cp_activation_bytes",
    "cp_extra_flops",
    "cp_layer_exchange_bytes",
    "cp_link",
    "cp_traffic",
    "exchange_element_bytes",
    "exchange_width",
    "fold_cp",
    "search_cp_sizes",
]

#: recompute modes whose rebuilt forward runs the attention core again (and so gathers again)
REGATHER = ("full", "selective")


def _is_mla(config: Any) -> bool:
    return hasattr(config, "kv_lora_rank")


def check_seq_len(seq_len: int, cp: int, sp_tp: int = 1) -> None:
    """Refuse a sequence that does not cut into 2 * cp equal chunks (each of them split over
    `sp_tp` ranks: tp under sequence parallelism, else 1), as the strategy does.

    Raises:
        ValueError: cp < 1, or seq_len not a multiple of 2 * cp * sp_tp.
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be an int >= 1, got {cp!r}")
    if cp > 1 and seq_len % (2 * cp * sp_tp):
        what = f"2*cp={2 * cp}" if sp_tp == 1 else f"2*cp*tp={2 * cp * sp_tp} (sequence parallel)"
        raise ValueError(
            f"context parallelism cuts each sequence into 2*cp={2 * cp} chunks: "
            f"seq_len={seq_len} is not a multiple of {what}; pick a seq_len that is, or "
            "another cp"
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


def exchange_element_bytes(config: Any, precision: str) -> int:
    """Bytes per element of what cp gathers under a Trainer precision: dense K and V are linear
    outputs (the autocast dtype); MLA's latent is RMSNorm(c_KV), its fp32 weight times the
    normalized input, so fp32 under autocast, concatenated with the rope key into one
    buffer of that dtype."""
    dt = dtypes_for(precision)
    return max(dt.param, dt.gemm) if _is_mla(config) else dt.gemm


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


def fold_cp(config: Any, layout: PlanLayout, workload: Workload) -> tuple[PlanLayout, Workload]:
    """The layout and workload the rest of the planner prices (module docstring): cp folded
    into dp (dp x cp ranks), each sequence's seq_len / cp tokens as a sequence of its own
    (cp times as many of them, so the microbatches per replica and the tokens per step stay).
    Unchanged when cp = 1.

    Raises:
        ValueError: what the strategy refuses: seq_len not a multiple of 2 * cp (2 * cp * tp
            under sequence parallelism), a model `check_context_config` refuses.
    """
    if layout.cp == 1:
        return layout, workload
    check_context_config(config, layout.cp)
    sp_tp = layout.tp if layout.sequence_parallel else 1
    check_seq_len(workload.seq_len, layout.cp, sp_tp)
    folded = replace(layout, dp=layout.dp * layout.cp, cp=1)
    local = replace(
        workload,
        seq_len=workload.seq_len // layout.cp,
        global_batch_size=workload.global_batch_size * layout.cp,
    )
    return folded, local


def cp_traffic(
    config: Any,
    layout: PlanLayout,
    workload: Workload,
    chunks: list[list[int]],
    last: bool,
) -> tuple[float, int]:
    """(bytes, collective calls) one rank of a pipeline stage exchanges over its cp group per
    optimizer step: per microbatch and attention layer (`chunks`' decoder layers, and the
    MTP modules' blocks when the stage is the `last`) one all-gather and one reduce-scatter of
    `cp_layer_exchange_bytes` for micro_batch_size sequences at this tp rank's width (in
    `exchange_element_bytes`), and one
    more all-gather where the layer's recompute mode rebuilds attention (`REGATHER`).
    (0, 0) when cp = 1."""
    if layout.cp == 1:
        return 0.0, 0
    check_seq_len(workload.seq_len, layout.cp)
    per_token = exchange_width(config, layout.tp) * exchange_element_bytes(
        config, workload.precision
    )
    one = (layout.cp - 1) * (workload.seq_len // layout.cp) * workload.micro_batch_size
    modes = [mode for chunk in chunks for mode in layout.chunk_recomputes(chunk)]
    modes += _mtp_modes(config, layout, last)
    calls = sum(2 + (mode in REGATHER) for mode in modes)
    micro = workload.num_microbatches(layout)
    return float(micro * calls * one * per_token), micro * calls


def _mtp_modes(config: Any, layout: PlanLayout, last: bool) -> list[str | None]:
    """The recompute mode of each MTP block on the last stage (the layout's mode: the MTP
    modules recompute as the layout says, `stage_flops`)."""
    return [layout.recompute] * getattr(config, "mtp_depth", 0) if last else []


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


def _layer_bytes(config: Any, layout: PlanLayout, workload: Workload) -> tuple[int, int]:
    """(gathered, expanded) bytes of one layer for the whole microbatch's sequence, beyond
    what the rank's own tokens already count: the gathered buffer (MLA: latent + rope key;
    dense: K and V of the kv heads, which the attention kernel saves as they are) and, for
    MLA, the keys and kv_b output of every head (q_nope / rope concatenated keys, values)
    the kernel saves for the whole sequence (the linear layers' dtype)."""
    b, s, cp = workload.micro_batch_size, workload.seq_len, layout.cp
    others = b * (s - s // cp)  # tokens of the other cp ranks
    width = exchange_width(config, layout.tp)
    gathered = others * width * exchange_element_bytes(config, workload.precision)
    g = dtypes_for(workload.precision).gemm
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
) -> CpActivations:
    """What the gathered context adds to a rank's activations (`CpActivations`), per layer
    by its recompute mode:

    * none: the gathered buffer and (MLA) the expanded keys and values of the other ranks'
      tokens are saved (`_layer_bytes`);
    * "light" (MLA's up-projections rebuilt): the gathered latent is saved, the expansion
      is rebuilt in backward (transient);
    * "full" / "selective": nothing is saved; the layer's backward rebuilds both (transient);

    the MTP blocks of the `last` stage count with its last chunk, under the layout's mode;

    plus, once per chunk (its layers share it, checkpoints keep it as an input), the causal
    mask by global position, a [seq_len / cp, seq_len] bool tensor.
    """
    if layout.cp == 1:
        return CpActivations([0] * len(chunks), 0)
    gathered, expanded = _layer_bytes(config, layout, workload)
    saved, transient = [], 0
    mask = (workload.seq_len // layout.cp) * workload.seq_len
    for index, chunk in enumerate(chunks):
        total = mask
        modes = layout.chunk_recomputes(chunk)
        if index == len(chunks) - 1:
            modes += _mtp_modes(config, layout, last)
        for mode in modes:
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


def search_cp_sizes(config: Any, ranks: int, seq_len: int) -> list[int]:
    """cp sizes a layout search tries for `ranks` data-parallel-or-cp ranks: 1, and, for a
    model cp runs (`check_context_config`), every divisor of `ranks` that cuts seq_len into 2 * cp
    whole chunks while leaving each rank at least `MIN_TOKENS_PER_CP_RANK` tokens."""
    try:
        check_context_config(config, 2)
    except ValueError:
        return [1]
    return [
        cp
        for cp in range(1, ranks + 1)
        if ranks % cp == 0
        and (cp == 1 or (seq_len % (2 * cp) == 0 and seq_len // cp >= MIN_TOKENS_PER_CP_RANK))
    ]


def cp_extra_flops(
    config: Any, layout: PlanLayout, workload: Workload, chunks: list[list[int]], last: bool
) -> tuple[float, float]:
    """(FLOPs, of which plain linear-layer FLOPs) one rank of a stage computes per step beyond
    its share of the model's FLOPs under cp > 1, per decoder layer of `chunks`:

    * scores and values over the masked-out half of the keys: with a mask the kernel does not
      skip it, ``6 * heads * (qk_head_dim + v_head_dim) * seq_len / 2`` per token (training);
    * MLA: `kv_b_proj` on the other ranks' tokens, ``6 * kv_lora_rank * heads * (nope + v)
      * (cp - 1)`` per token of this rank (a linear layer);

    and the same for each MTP block when the stage is the `last`.

    Both over tp (heads split), times 4/3 where recompute "full" or "selective" runs the
    attention forward again; "light" runs MLA's up-projections twice more. (0, 0) when cp = 1.
    """
    if layout.cp == 1:
        return 0.0, 0.0
    c = config
    mla = _is_mla(c)
    qk, v = (c.qk_head_dim, c.v_head_dim) if mla else (c.head_dim, c.head_dim)
    masked = 6.0 * c.num_heads * (qk + v) * workload.seq_len / 2
    expand = 0.0
    if mla:
        expand = 6.0 * c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + v) * (layout.cp - 1)
    total = linear = 0.0
    modes = [mode for chunk in chunks for mode in layout.chunk_recomputes(chunk)]
    for mode in modes + _mtp_modes(config, layout, last):
        again = 4 / 3 if mode in REGATHER else 1.0
        up = 1 + 2 / 3 if mode == "light" else again
        total += masked * again + expand * up
        linear += expand * up
    tokens = workload.tokens_per_step / (layout.dp * layout.cp)  # this rank's tokens
    return total / layout.tp * tokens, linear / layout.tp * tokens


def add_cp_traffic(comm: CommEstimate, traffic: tuple[float, int]) -> CommEstimate:
    """`comm` with the cp group's bytes and calls (`cp_traffic`) added, when there are any."""
    nbytes, calls = traffic
    if not calls:
        return comm
    return replace(
        comm,
        bytes_per_step={**comm.bytes_per_step, "cp": nbytes},
        calls_per_step={**comm.calls_per_step, "cp": calls},
        detail={
            **comm.detail,
            "cp": f"K/V (MLA: latent) all-gather + reduce-scatter: {calls} calls, "
            f"{nbytes:.4g} bytes",
        },
    )


def add_cp_activations(est: ActivationEstimate, extra: CpActivations) -> ActivationEstimate:
    """`est` with the gathered context a cp rank holds (`cp_activation_bytes`): its saved
    bytes for every (microbatch, chunk) in flight at the largest chunk's size, its
    transient on top of the recomputation transient."""
    saved = max(extra.per_microbatch_chunk, default=0) * est.in_flight
    if not saved and not extra.transient:
        return est
    return replace(
        est,
        per_microbatch_chunk=[
            a + b for a, b in zip(est.per_microbatch_chunk, extra.per_microbatch_chunk, strict=True)
        ],
        saved_peak=est.saved_peak + saved,
        transient=est.transient + extra.transient,
        peak=est.peak + saved + extra.transient,
        detail={**est.detail, "cp_context": sum(extra.per_microbatch_chunk)},
    )
