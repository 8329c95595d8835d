"""One pipeline rank's share of a model: its chunks of layers, plus the embedding on the rank
of the first virtual stage and the final norm, head and MTP modules on the rank of the last
(the same rank in DualPipeV's V, `nanotrain.parallel.placement`).

`build_pipeline_stage` builds the whole model on the meta device (no memory), materializes
only the modules this rank owns and initializes them with `init_weights`, which makes (and
drops) the random draws of the modules it skips: every stage gets exactly the weights the
whole model gets from the same seed, so pipeline runs compare with one process directly.

The stage registers the owned modules under the whole model's names (``embed_tokens``,
``layers.<global index>``, ``norm``, ``lm_head``, ``mtp``), so parameter names, checkpoints
and optimizer groups read like the whole model's, restricted to this rank.

The last stage also holds a copy of the embedding when the MTP modules (which embed the
shifted tokens) or tied embeddings need it, as Megatron does; the strategy sums that copy's
gradient with the first stage's (`shared_parameter_names`), so both copies stay equal. In a
V the first and last stage share a rank, and so the one embedding.

How the schedule drives a stage: before each forward it calls ``select(chunk, input)`` with
the received activation; ``forward(input_ids, labels)`` then runs that chunk and returns a
`StageOutput` (``partial=True``: ``hidden`` goes to the next stage, ``total_loss`` is this
chunk's own loss term). After the schedule the strategy knows the global loss terms and calls
``replay(output)``: the next forward returns that `ModelOutput` as it is, so a module's
``training_step``/``validation_step`` log global values on every stage, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanotrain.models.balance import MoEStats, moe_balance_step
from nanotrain.models.build import build_model, init_weights
from nanotrain.models.layers import tp_size_of
from nanotrain.models.moe import DeepSeekMoE
from nanotrain.models.transformer import CausalLM, ModelOutput, total_loss
from nanotrain.parallel.pipeline import stage_layers
from nanotrain.parallel.placement import StagePlacement

__all__ = ["PipelineStage", "StageOutput", "build_pipeline_stage"]


@dataclass
class StageOutput(ModelOutput):
    """What one chunk's forward returns inside a pipeline schedule.

    Attributes (besides `ModelOutput`'s, which hold this chunk's own terms only):
        hidden: [B, T, H] ([B, T / tp, H] under SP) activation for the next stage; None on
            the last stage.
        partial: always True: the loss terms are this stage's share, not the model's.
    """

    hidden: torch.Tensor | None = None
    partial: bool = True


class PipelineStage(nn.Module):
    """The modules of one pipeline rank (see the module docstring) and how to run a chunk.

    Args:
        full: the whole model as built on the meta device; the owned modules are its own
            module objects (so its methods, e.g. ``mtp_losses``, work on them).
        chunks: layer indices of each local chunk (`stage_layers`).
        pp_size, pp_rank: the pipeline size and this rank's stage.
        v_shape: the chunks sit in DualPipeV's V (`nanotrain.parallel.placement`); False:
            interleaved.
    """

    def __init__(
        self,
        full: CausalLM,
        chunks: Sequence[Sequence[int]],
        pp_size: int,
        pp_rank: int,
        v_shape: bool = False,
    ) -> None:
        super().__init__()
        self.config = full.config
        self.tp_group = full.tp_group
        self.sequence_parallel = full.sequence_parallel
        self.chunks = [list(c) for c in chunks]
        self.pp_size, self.pp_rank = pp_size, pp_rank
        self.placement = StagePlacement(pp_size, len(self.chunks), v_shape)
        self.num_virtual = self.placement.num_virtual
        self._full = [full]  # a list: not registered, its unowned parts stay on meta
        first, last = self.placement.holds_first(pp_rank), self.placement.holds_last(pp_rank)
        mtp = len(getattr(full, "mtp", ())) > 0
        if first or (last and (mtp or self.config.tie_word_embeddings)):
            self.embed_tokens = full.embed_tokens
        self.layers = nn.ModuleDict({str(i): full.layers[i] for c in self.chunks for i in c})
        if last:
            self.norm, self.lm_head = full.norm, full.lm_head
            if mtp:
                self.mtp = full.mtp
        self._chunk = 0
        self._input: torch.Tensor | None = None
        self._replay: ModelOutput | None = None

    @property
    def full(self) -> CausalLM:
        """The whole model object (unowned modules on the meta device)."""
        return self._full[0]

    def is_first_chunk(self, chunk: int) -> bool:
        """Whether local `chunk` is virtual stage 0 (embeds the tokens)."""
        return self.placement.stage(self.pp_rank, chunk) == 0

    def is_last_chunk(self, chunk: int) -> bool:
        """Whether local `chunk` is the last virtual stage (head, loss, MTP)."""
        return self.placement.stage(self.pp_rank, chunk) == self.num_virtual - 1

    def shared_parameter_names(self) -> list[str]:
        """Names of parameters that another stage also holds (the embedding copy on the first
        and last stage); empty when this stage shares nothing (also when one rank holds both
        ends, as in a V)."""
        if self.pp_size == 1 or not hasattr(self, "embed_tokens"):
            return []
        if self.placement.holds_first(self.pp_rank) and self.placement.holds_last(self.pp_rank):
            return []
        last_has = (len(getattr(self.full, "mtp", ())) > 0) or self.config.tie_word_embeddings
        return ["embed_tokens.weight"] if last_has else []

    def activation_shape(self, input_shape: Sequence[int]) -> tuple[int, int, int]:
        """Shape of the activation between stages for input_ids of shape [B, T]."""
        b, t = input_shape
        tp = tp_size_of(self.tp_group) if self.sequence_parallel else 1
        return (b, t // tp, self.config.hidden_size)

    def bind_second_chunk(
        self, ep_group: Any, paired_ep_group: Any, paired_node_groups: Any = None
    ) -> None:
        """Make the MoE layers of local chunk 1 (and the MTP blocks, which belong to the last
        stage, a chunk 1 under both placements) run their all-to-alls on `paired_ep_group`
        instead of `ep_group` (the same ranks), and their node-limited dispatch, where set,
        on `paired_node_groups`.

        Raises:
            ValueError: without exactly two chunks, or without a paired group where the
                chunk has MoE layers and experts are split.
        """
        if len(self.chunks) != 2:
            raise ValueError(f"paired chunks need two chunks per rank, got {len(self.chunks)}")
        modules = [self.layers[str(i)] for i in self.chunks[1]]
        if self.is_last_chunk(1):
            modules += list(getattr(self, "mtp", ()))
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, DeepSeekMoE) and sub.ep_group is ep_group:
                    if paired_ep_group is None and ep_group is not None:
                        raise ValueError("paired chunks need the mesh's paired_ep_group")
                    sub.ep_group = paired_ep_group
                    if sub.node_groups is not None:
                        if paired_node_groups is None:
                            raise ValueError("paired chunks need the mesh's paired node groups")
                        sub.node_groups = paired_node_groups

    # -- driven by the schedule ----------------------------------------------------------------
    def select(self, chunk: int, input_tensor: torch.Tensor | None) -> None:
        """Run local `chunk` on `input_tensor` (None on the first stage) at the next forward."""
        if not 0 <= chunk < len(self.chunks):
            raise ValueError(f"chunk {chunk} is outside [0, {len(self.chunks)})")
        self._chunk, self._input = chunk, input_tensor

    def replay(self, output: ModelOutput) -> None:
        """Make the next forward return `output` unchanged (the global loss terms)."""
        self._replay = output

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        """Run the selected chunk: input_ids, labels [B, T] -> `StageOutput`, or the replayed
        `ModelOutput` after `replay`."""
        if self._replay is not None:
            out, self._replay = self._replay, None
            return out
        chunk, full = self._chunk, self.full
        if self.is_first_chunk(chunk):
            full._check_input(input_ids, labels)
            h = full.embed(input_ids)  # (B, T, H), (B, T / tp, H) under sequence parallelism
        elif self._input is None:
            raise ValueError(f"chunk {chunk} of stage {self.pp_rank} needs an input activation")
        else:
            h = self._input
        self._input = None
        aux = h.new_zeros((), dtype=torch.float32)
        if self.chunks[chunk]:
            # each ([B,] T, rope_dim / 2); the block-causal mask with `documents`
            cos, sin, mask = full.attention_inputs(h, input_ids)
            for i in self.chunks[chunk]:
                h, layer_aux = self.layers[str(i)](h, cos, sin, mask)
                aux = aux + layer_aux
        if not self.is_last_chunk(chunk):
            return StageOutput(logits=None, aux_loss=aux, total_loss=aux, hidden=h)
        return self._head(h, input_ids, labels, aux)

    def _head(
        self, h: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None, aux: Any
    ) -> StageOutput:
        full = self.full
        logits, loss, count = full.head_and_loss(h, full.document_labels(input_ids, labels))
        mtp_loss = per_depth = None
        if labels is not None and self.training and hasattr(self, "mtp"):
            per_depth, mtp_aux = full.mtp_losses(h, input_ids, labels)
            mtp_loss = per_depth.mean()
            aux = aux + mtp_aux
        total = total_loss(loss, aux, mtp_loss, getattr(self.config, "mtp_loss_weight", 0.0))
        return StageOutput(logits, loss, aux, mtp_loss, total, count, per_depth)

    # -- MoE bias balancing --------------------------------------------------------------------
    def indexed_moe_layers(self) -> list[tuple[int, DeepSeekMoE]]:
        """(global layer index, module) of this stage's DeepSeekMoE layers: its decoder layers
        in index order, then MTP module d as ``num_layers + d`` (last stage only)."""
        found = [(int(i), layer.mlp) for i, layer in self.layers.items()]
        found += [
            (self.config.num_layers + d, m.block.mlp)
            for d, m in enumerate(getattr(self, "mtp", ()))
        ]
        return sorted((i, m) for i, m in found if isinstance(m, DeepSeekMoE))

    def moe_layers(self) -> list[DeepSeekMoE]:
        """The DeepSeekMoE modules of this stage (its layers first, then MTP blocks)."""
        return [m for _, m in self.indexed_moe_layers()]

    def balance_experts(self, reduce_fn: Any = None) -> MoEStats | None:
        """Aux-loss-free balancing of this stage's MoE layers (see
        `CausalLM.balance_experts`; each layer lives on one stage only, so summing its
        counts over data parallelism gives the global batch's)."""
        indexed = self.indexed_moe_layers()
        return moe_balance_step(
            [m for _, m in indexed],
            [i for i, _ in indexed],
            getattr(self.config, "bias_update_speed", 0.0),
            reduce_fn,
            self.tp_group if self.sequence_parallel else None,
        )

    def update_router_biases(self, reduce_fn: Any = None) -> torch.Tensor:
        """`balance_experts`, returning only the loads [L, E] ([0, 0] without MoE layers)."""
        stats = self.balance_experts(reduce_fn)
        return torch.zeros(0, 0) if stats is None else stats.loads


def build_pipeline_stage(
    config: Any,
    mesh: Any,
    *,
    virtual_pp: int = 1,
    layout: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
    sequence_parallel: bool = False,
    v_shape: bool = False,
    paired_chunks: bool = False,
) -> PipelineStage:
    """Build and initialize this rank's `PipelineStage` of `config` on `mesh` (pp from it).

    Args:
        config: DenseConfig or DeepSeekConfig.
        mesh: a ParallelMesh (its pp size and rank pick the chunks, its tp group splits them,
            its ep group splits the routed experts of the stage's MoE layers).
        virtual_pp: chunks per rank (interleaved schedule).
        layout: layers per virtual stage (see `nanotrain.parallel.pipeline.partition_layers`).
        device: where the owned modules live (None = "cpu").
        generator: optional torch.Generator for the initialization (as `build_model`).
        sequence_parallel: as `build_model`.
        v_shape: place the two chunks in DualPipeV's V (`nanotrain.parallel.placement`).
        paired_chunks: the second chunk's MoE layers (and MTP blocks, when this rank holds the
            last stage) use ``mesh.paired_ep_group``, so that its all-to-alls may run while
            the first chunk's do (the executor's ``overlap``); needs two chunks.

    Raises:
        ValueError: when the layers do not split into pp × virtual_pp chunks as asked.
    """
    pp, rank = mesh.pp_size, mesh.pp_rank
    chunks = stage_layers(config.num_layers, pp, rank, virtual_pp, layout, v_shape)
    full = build_model(config, mesh=mesh, device="meta", sequence_parallel=sequence_parallel)
    stage = PipelineStage(full, chunks, pp, rank, v_shape)
    if paired_chunks:
        stage.bind_second_chunk(
            mesh.ep_group, mesh.paired_ep_group, getattr(mesh, "paired_ep_node_groups", None)
        )
    device = torch.device("cpu" if device is None else device)
    for module in stage.children():
        module.to_empty(device=device)
    full.tie_weights()  # to_empty makes new tensors, breaking the tie
    init_weights(full, generator)
    for buf in stage.buffers():
        buf.zero_()
    return stage
