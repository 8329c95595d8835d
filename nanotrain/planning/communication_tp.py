"""The tensor-parallel part of the communication model: the tp collectives one microbatch runs
on a pipeline rank, and the elements whose grads sequence parallelism sums over tp once per
step. `nanotrain.planning.communication` turns them into the "tp" group's bytes and calls.

Per microbatch, following `MegatronStrategy`'s code paths: the vocab-parallel embedding
(all-reduce; under sequence parallelism reduce-scatter forward, all-gather backward), each
attention and MLP block's one input collective (identity / all-reduce of the grad; all-gather /
reduce-scatter under SP) and one output collective (all-reduce; reduce-scatter / all-gather
under SP) (Shoeybi et al. 2019, Korthikanti et al. 2022), MLA's latents instead of the hidden
state, the MoE shared experts, the LM head's input and the vocab-parallel cross-entropy's two
per-token reductions, once more per MTP depth; the MoE balance-loss statistics under SP; under
SP the backward all-gather of every input saved as its shard, where the block is not
recomputed; and the forward collectives that recomputation reruns (under "full" the heads' and
losses' too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanotrain.parallel.grads import sequence_parallel_params
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.planning.rank_model import RankModel

if TYPE_CHECKING:
    from nanotrain.planning.communication import WireDtypes

__all__ = ["TpCollective", "is_moe_layer", "mtp_is_moe", "sp_grad_numel", "tp_collectives"]


@dataclass(frozen=True)
class TpCollective:
    """One collective of one microbatch's pass over a module."""

    op: str  # "all_reduce" | "all_gather" | "reduce_scatter"
    numel: int  # the full tensor (ring model's N)
    itemsize: int
    backward: bool
    where: str = "head"  # "attn", "mlp" (inside a decoder layer: recomputed) or "head"
    regather: bool = False  # backward's all-gather of an input saved as its shard

    def wire(self, g: int) -> float:
        """Wire bytes this rank sends for it over a group of `g` ranks (ring model)."""
        factor = 2 * (g - 1) / g if self.op == "all_reduce" else (g - 1) / g
        return factor * self.numel * self.itemsize


def _enter(numel: int, itemsize: int, sp: bool, where: str) -> list[TpCollective]:
    """`enter_tensor_parallel_region`: identity / grad all-reduce; under SP all-gather /
    grad reduce-scatter, and the all-gather in backward of the input its layers saved as this
    rank's shard (`nanotrain.parallel.sp_regather`; not in a recomputed block)."""
    if sp:
        return [
            TpCollective("all_gather", numel, itemsize, False, where),
            TpCollective("reduce_scatter", numel, itemsize, True, where),
            TpCollective("all_gather", numel, itemsize, True, where, regather=True),
        ]
    return [TpCollective("all_reduce", numel, itemsize, True, where)]


def _exit(numel: int, itemsize: int, sp: bool, where: str) -> list[TpCollective]:
    """A row-parallel output (or the vocab-parallel embedding): all-reduce / identity; under
    SP reduce-scatter / grad all-gather."""
    if sp:
        return [
            TpCollective("reduce_scatter", numel, itemsize, False, where),
            TpCollective("all_gather", numel, itemsize, True, where),
        ]
    return [TpCollective("all_reduce", numel, itemsize, False, where)]


def _layer_colls(
    config: Any, moe: bool, batch: int, tokens: int, sp: bool, dt: WireDtypes
) -> list[TpCollective]:
    """tp collectives of one decoder layer on one microbatch of `batch` sequences holding
    `tokens` tokens in all."""
    h = config.hidden_size
    out: list[TpCollective] = []
    if hasattr(config, "kv_lora_rank"):  # MLA: the latents enter the region, not x
        width = (config.q_lora_rank or 0) + config.kv_lora_rank + config.qk_rope_head_dim
        out += _enter(tokens * width, dt.act, sp, "attn")
        if config.q_lora_rank is None:  # q_proj reads x and enters it itself
            out += _enter(tokens * h, dt.act, sp, "attn")
    else:
        out += _enter(tokens * h, dt.act, sp, "attn")
    out += _exit(tokens * h, dt.matmul, sp, "attn")
    if not moe or config.n_shared_experts > 0:  # dense MLP, or the MoE's shared experts
        out += _enter(tokens * h, dt.act, sp, "mlp")
        out += _exit(tokens * h, dt.matmul, sp, "mlp")
    if moe and sp and config.aux_loss_alpha > 0:
        # the sequence-wise balance loss sums [2, b, E] fp32 statistics over tp (forward only)
        out.append(TpCollective("all_reduce", 2 * batch * config.n_routed_experts, 4, False, "mlp"))
    if moe and sp and getattr(config, "capacity_factor", None) is not None:
        # capacity per whole sequence: the MoE gathers its input and the routing (fp32 weights,
        # their grads reduce-scattered back; int64 choices) before its slots
        copies = tokens * config.num_experts_per_tok
        out += [
            TpCollective("all_gather", tokens * h, dt.act, False, "mlp"),
            TpCollective("reduce_scatter", tokens * h, dt.act, True, "mlp"),
            TpCollective("all_gather", copies, 4, False, "mlp"),
            TpCollective("reduce_scatter", copies, 4, True, "mlp"),
            TpCollective("all_gather", copies, 8, False, "mlp"),
        ]
    return out


def _head_colls(config: Any, tokens: int, sp: bool, dt: WireDtypes) -> list[TpCollective]:
    """LM head input, then the vocab-parallel cross-entropy's max and [2, tokens] sums (fp32,
    forward only)."""
    return _enter(tokens * config.hidden_size, dt.act, sp, "head") + [
        TpCollective("all_reduce", tokens, 4, False),
        TpCollective("all_reduce", 2 * tokens, 4, False),
    ]


def _head_recomputed(head: list[TpCollective], recompute: str | None) -> list[TpCollective]:
    """Forward collectives of a head (`_head_colls`) rerun in backward: under "full" the norm,
    head and loss are checkpointed too (`CausalLM.norm_head_loss`), and the loss saves tensors
    after its last all-reduce, so all of them."""
    return [c for c in head if not c.backward] if recompute == "full" else []


def is_moe_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` of `config` is a MoE layer (never for a dense config)."""
    return bool(getattr(config, "is_moe_layer", lambda i: False)(layer))


def mtp_is_moe(config: Any) -> bool:
    """Whether the MTP blocks of `config` are MoE layers (as its last decoder layer)."""
    return hasattr(config, "first_k_dense_replace") and (
        config.first_k_dense_replace < config.num_layers
    )


def _recomputed(
    colls: list[TpCollective], recompute: str | None, trailing_kept: bool
) -> list[TpCollective]:
    """Forward collectives a decoder layer reruns in backward.

    torch's non-reentrant checkpoint stops recomputing once every tensor autograd saved is
    back, so a trailing collective whose output nothing saves is not rerun: attention's
    output collective under "selective" (the residual add keeps nothing), and under "full"
    the MLP's output collective unless something after it saves tensors
    (`trailing_kept`: the MoE balance loss, computed last, keeps the routing statistics).
    """
    if recompute is None:
        return []
    forward = [c for c in colls if not c.backward]
    if recompute == "selective":
        return [c for c in forward if c.where == "attn"][:-1]
    return forward if trailing_kept else forward[:-1]


def _saved_as_shards(colls: list[TpCollective], recompute: str | None) -> list[TpCollective]:
    """`colls` without the regathers of the blocks that recompute instead ("full": every
    block, the heads too; "selective": attention)."""
    if recompute == "full":
        return [c for c in colls if not c.regather]
    if recompute == "selective":
        return [c for c in colls if not (c.regather and c.where == "attn")]
    return colls


def _keeps_trailing(config: Any, moe: bool) -> bool:
    """Whether a layer saves tensors after its last tp collective (see `_recomputed`): a MoE
    layer computing the balance loss, or one without shared experts (its last tp collective
    is attention's, followed by the router)."""
    if not moe:
        return False
    return config.aux_loss_alpha > 0 or config.n_shared_experts == 0


def tp_collectives(
    config: Any, layout: PlanLayout, workload: Workload, rank: RankModel, dt: WireDtypes
) -> list[TpCollective]:
    """The tp collectives one microbatch runs on pipeline rank `rank.pp_rank`, recomputed ones
    included (see the module docstring); `dt` gives each one's bytes per element."""
    sp, b, s = layout.sequence_parallel, workload.micro_batch_size, workload.seq_len
    tokens, h, last = b * s, config.hidden_size, layout.pp * layout.virtual_pp - 1
    colls: list[TpCollective] = []
    for c, layers in enumerate(rank.chunks):
        stage = layout.placement.stage(rank.pp_rank, c)
        if stage == 0:
            colls += _exit(tokens * h, dt.param, sp, "head")  # vocab-parallel embedding
        for i, mode in zip(layers, layout.chunk_recomputes(layers), strict=True):
            moe = is_moe_layer(config, i)
            layer = _layer_colls(config, moe, b, tokens, sp, dt)
            colls += _saved_as_shards(layer, mode)
            colls += _recomputed(layer, mode, _keeps_trailing(config, moe))
        if stage == last:
            head = _head_colls(config, tokens, sp, dt)
            head_saved = _saved_as_shards(head, layout.recompute)
            colls += head_saved + _head_recomputed(head, layout.recompute)
            for _ in range(getattr(config, "mtp_depth", 0)):
                moe = mtp_is_moe(config)
                block = _layer_colls(config, moe, b, tokens, sp, dt)
                colls += _exit(tokens * h, dt.param, sp, "head")  # embeds the shifted ids
                colls += _saved_as_shards(block, layout.recompute)
                colls += _recomputed(block, layout.recompute, _keeps_trailing(config, moe))
                colls += head_saved + _head_recomputed(head, layout.recompute)
    return colls


def sp_grad_numel(rank: RankModel, layout: PlanLayout) -> float:
    """Elements of the grads of tp-replicated parameters this rank sums over tp once per step
    under sequence parallelism; under ZeRO-2 only its own pieces (their mean over dp ranks)."""
    dense, experts = _sp_param_numels(rank)
    if layout.zero_stage == 2:
        return dense / layout.dp + experts / layout.expert_dp
    return dense + experts


def _sp_param_numels(rank: RankModel) -> tuple[int, int]:
    """Elements of the tp-replicated params whose grads are summed over tp under SP (dense,
    routed experts)."""
    cached = _SP_NUMELS.get(id(rank))
    if cached is not None and cached[0] is rank:  # a search asks once per layout and stage
        return cached[1]
    # a pipeline stage's modules are its whole model's: its replicated parameters are the
    # whole model's among its own (listed once per whole model, not per stage)
    replicated = _replicated_ids(getattr(rank.module, "full", rank.module))
    out = (
        sum(p.numel() for p in rank.dense if id(p) in replicated),
        sum(p.numel() for p in rank.experts if id(p) in replicated),
    )
    if len(_SP_NUMELS) > 4096:
        _SP_NUMELS.clear()
    _SP_NUMELS[id(rank)] = (rank, out)
    return out


_SP_NUMELS: dict[int, tuple[RankModel, tuple[int, int]]] = {}


def _replicated_ids(module: Any) -> set[int]:
    """``id`` of each parameter of `sequence_parallel_params(module)`, kept per module."""
    hit = _SP_IDS.get(id(module))
    if hit is None or hit[0] is not module:
        if len(_SP_IDS) > 256:
            _SP_IDS.clear()
        hit = _SP_IDS[id(module)] = (module, {id(p) for p in sequence_parallel_params(module)})
    return hit[1]


_SP_IDS: dict[int, tuple[Any, set[int]]] = {}
