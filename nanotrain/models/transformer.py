"""The decoder stack shared by both families, and the Llama-style dense model.

A model is three separable steps so pipeline parallelism can cut it into stages:
`embed(input_ids)` -> the `layers` ModuleList (each `layer(h, cos, sin, mask) -> (h, aux_loss)`)
-> `head_and_loss(h, labels)`. With `documents` set (`nanotrain.models.documents`), attention
stays inside each packed document and positions restart at each one: `attention_inputs` makes
the per-token rotary tables and the block-causal mask from input_ids.

Shapes: B batch, T sequence, H hidden, V vocabulary (padded to a multiple of tp: the head
holds V / tp columns per rank). Under sequence parallelism the hidden states between the
tensor-parallel matmuls are (B, T / tp, H) on each rank. Under context parallelism
(`nanotrain.parallel.context`) a rank holds T / cp tokens of each sequence (two chunks): T
below is then this rank's part, and the rotary tables and causal mask follow the tokens'
global positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanotrain.models.attention import DenseAttention
from nanotrain.models.balance import MoEStats, moe_balance_step
from nanotrain.models.config import DeepSeekConfig, DenseConfig
from nanotrain.models.documents import DocumentMask, DocumentView, rope_at
from nanotrain.models.layers import RMSNorm, SwiGLU, rope_cos_sin, tp_size_of
from nanotrain.models.moe import DeepSeekMoE
from nanotrain.models.recompute import (
    check_full_layers,
    check_recompute,
    rebuilt_norm_then,
    recomputed,
)
from nanotrain.parallel.collectives import group_rank, group_size
from nanotrain.parallel.context import causal_mask, chunk_positions, gather_sequence
from nanotrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from nanotrain.parallel.tensor import ColumnParallelLinear, VocabParallelEmbedding, pad_vocab_size


@dataclass
class ModelOutput:
    """What a model forward returns.

    Attributes:
        logits: [B, T, V / tp] next-token logits.
        loss: mean next-token cross-entropy over labels != -100 (None without labels).
        aux_loss: sum over MoE layers of alpha x the sequence-wise balance loss (0 if none).
        mtp_loss: mean over MTP depths of their cross-entropy, NOT multiplied by lambda
            (None without labels or without MTP).
        total_loss: loss + aux_loss + lambda * mtp_loss, the value to backpropagate
            (None without labels).
        num_tokens: number of labels != -100 (int64 scalar; None without labels), for
            token-weighted averaging over microbatches.
        mtp_losses: [D] each MTP depth's cross-entropy, a mean over that depth's own targets
            (`mtp_loss` is their mean); None when `mtp_loss` is.
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    total_loss: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    mtp_losses: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h)).

    `mlp` may be a SwiGLU (returns a tensor) or a DeepSeekMoE (returns (tensor, aux_loss)).
    Shapes: forward(h [B, T, H], cos, sin, mask=None) -> (h [B, T, H], aux_loss scalar
    float32); under sequence parallelism h is [B, T / tp, H] (the norms and residual adds run
    on this rank's tokens) while cos, sin ([T, d] or per token [B, T, d]) and the optional
    block-causal mask [B, 1, T, T] cover all T positions.
    """

    def __init__(self, attention: nn.Module, mlp: nn.Module, hidden: int, eps: float, device: Any):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps, device=device)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps, device=device)
        self.mlp = mlp
        self.recompute: str | None = None  # activation recomputation (models/recompute.py)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recompute == "full":
            return recomputed(self._forward, h, cos, sin, mask)
        return self._forward(h, cos, sin, mask)

    def _forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recompute == "selective":
            h = h + recomputed(self.self_attn, self.input_layernorm(h), cos, sin, mask)
        elif self.recompute == "light":
            h = h + rebuilt_norm_then(self.input_layernorm, h, self.self_attn, cos, sin, mask)
        else:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        if self.recompute == "light":
            out = rebuilt_norm_then(self.post_attention_layernorm, h, self.mlp)
        else:
            out = self.mlp(self.post_attention_layernorm(h))
        if isinstance(out, tuple):
            out, aux = out
        else:
            aux = h.new_zeros((), dtype=torch.float32)
        return h + out, aux


def total_loss(
    loss: torch.Tensor | None,
    aux: torch.Tensor,
    mtp_loss: torch.Tensor | None = None,
    mtp_weight: float = 0.0,
) -> torch.Tensor | None:
    """What to backpropagate: loss + aux + mtp_weight * mtp_loss (None without a loss)."""
    if loss is None:
        return None
    total = loss + aux
    return total if mtp_loss is None else total + mtp_weight * mtp_loss


def masked_mean_ce(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: Any, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over labels != -100 (0 if there are none) and that token count.

    Args: logits [B, T, V / tp]; labels [B, T] int64.
    """
    # (B, T) float32, 0 where labels == -100
    per_token = vocab_parallel_cross_entropy(logits, labels, tp_group, vocab_size=vocab_size)
    count = (labels != -100).sum()
    return per_token.sum() / count.clamp(min=1), count


def _remake_kept_rope_tables(model: CausalLM, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: the kept rotary tables follow the loaded parameters."""
    if model._keep_rope:
        model._make_rope_tables()


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; subclasses choose the layers.

    Args:
        config: the model config. tp_group: tensor-parallel group or None.
        device: where parameters are created ("meta" builds without allocating).
        sequence_parallel: shard the activations between the tensor-parallel matmuls (embedding
            output, norms, residual stream) along the sequence over `tp_group`: hidden states
            are [B, T / tp, H] from the embedding to the head, which gathers them before the
            vocab-parallel cross-entropy. T must be divisible by tp.
        ep_group: expert-parallel group splitting the routed experts of MoE layers (None: one
            rank holds them all; dense models ignore it).
        cp_group: context-parallel group: each rank holds two chunks of every sequence
            (`nanotrain.parallel.context`) and attention gathers the keys and values of the
            others (None: this rank holds whole sequences).
    """

    def __init__(
        self,
        config: DenseConfig | DeepSeekConfig,
        *,
        tp_group: Any,
        device: Any,
        sequence_parallel: bool = False,
        ep_group: Any = None,
        cp_group: Any = None,
    ):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.ep_group = ep_group
        self.cp_group = cp_group
        self.sequence_parallel = sequence_parallel
        c = config
        sp = {"sequence_parallel": sequence_parallel}
        self.embed_tokens = VocabParallelEmbedding(
            c.vocab_size, c.hidden_size, tp_group=tp_group, device=device, **sp
        )
        self.layers = nn.ModuleList(self.make_layer(i, device) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
        # the head's vocabulary is padded like the embedding's, so tying and sharding agree
        tp = 1 if tp_group is None else tp_group.size()
        self.lm_head = ColumnParallelLinear(
            c.hidden_size, pad_vocab_size(c.vocab_size, tp), tp_group=tp_group, device=device, **sp
        )
        self.tie_weights()
        # recompute "full" reruns the head and loss in backward too (set_recompute sets it)
        self.recompute_head = False
        # packed documents: block-causal attention, restarting positions (`set_document_mask`)
        self.documents: DocumentMask | None = None
        # (cos, sin) for max_seq_len positions, kept under torch.compile: `keep_rope_tables`
        self._keep_rope = False
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # parameters can arrive without a move (load_state_dict(assign=True) after a meta
        # build): make the kept tables then, outside any graph torch.compile traces
        self.register_load_state_dict_post_hook(_remake_kept_rope_tables)

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the embedding's tensor when `config.tie_word_embeddings`.

        Call again after anything that replaces parameter objects (`to_empty` from meta does).
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, layer_idx: int, device: Any) -> DecoderLayer:
        """Build decoder layer `layer_idx` (overridden per family)."""
        raise NotImplementedError

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each query/key head."""
        raise NotImplementedError

    def rope(self, seq_len: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables (cos, sin), each float32 [seq_len, rope_dim // 2]: computed per
        forward, or sliced from the tables `keep_rope_tables` keeps on the model's device."""
        tables = self._rope_tables
        if tables is not None and tables[0].device == device and seq_len <= len(tables[0]):
            return tables[0][:seq_len], tables[1][:seq_len]
        c = self.config
        return rope_cos_sin(seq_len, self.rope_dim, c.rope_theta, c.rope_scaling, device)

    def keep_rope_tables(self) -> None:
        """Keep the rotary tables for `max_seq_len` positions on the parameters' device (made
        again whenever the model moves) and slice them in every forward; `compile_model` calls
        this. Computed inside a compiled graph from `arange` alone, the tables are not read
        but recomputed by inductor within every layer's rope kernel, forward and backward
        (6% of a 1B dense step on an H100, measured); kept, they enter the graph as inputs.
        Not a buffer (nothing to initialize or checkpoint; float32 through
        `model.to(bfloat16)`) and not in the memory planner: max_seq_len * rope_dim * 4 bytes
        (42 MB for DeepSeek-V3's 163,840 positions).
        """
        self._keep_rope = True
        self._make_rope_tables()

    def _make_rope_tables(self) -> None:
        device = next((p.device for p in self.parameters() if not p.is_meta), None)
        self._rope_tables = None
        if device is not None:
            c = self.config
            # a move inside torch.inference_mode() would otherwise make inference tensors,
            # which a later training step's backward refuses to save
            with torch.inference_mode(False):
                self._rope_tables = rope_cos_sin(
                    c.max_seq_len, self.rope_dim, c.rope_theta, c.rope_scaling, device
                )

    def _apply(self, fn: Any, recurse: bool = True) -> CausalLM:
        # .to(device) / .cuda() / to_empty(): make the kept tables again where the parameters
        # now are (a dtype cast leaves them float32: they are recomputed, not cast)
        out = super()._apply(fn, recurse)
        if self._keep_rope:
            self._make_rope_tables()
        return out

    def full_seq_len(self, h: torch.Tensor) -> int:
        """Length T of the whole sequence of hidden states h [B, T_local, H]: T_local * tp under
        sequence parallelism (attention sees every position, so rope tables need all T)."""
        return h.shape[1] * (tp_size_of(self.tp_group) if self.sequence_parallel else 1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: input_ids [B, T] int64 -> h [B, T, H] ([B, T / tp, H] under SP)."""
        return self.embed_tokens(input_ids)

    def attention_inputs(
        self, h: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What every decoder layer reads besides h [B, T_local, H]: (cos, sin, mask).

        Without `documents` (or without input_ids): the tables for positions 0 .. T-1, each
        [T, rope_dim / 2], and mask None (causal). With them: each token's table at its
        position inside its document, [B, T, rope_dim / 2], and the block-causal mask
        [B, 1, T, T] from input_ids [B, T] (whole on every rank, also under SP).
        """
        cp = group_size(self.cp_group)
        if cp > 1:
            # this rank's two chunks: tables at their global positions, mask over all keys
            t = self.full_seq_len(h) * cp  # the whole sequence
            positions = chunk_positions(t, cp, group_rank(self.cp_group), h.device)
            cos, sin = self.rope(t, h.device)  # each (T, rope_dim / 2)
            if self.documents is None or not self.documents.mask_attention or input_ids is None:
                # (T / cp, rope_dim / 2) each, and [1, 1, T / cp, T]
                return cos[positions], sin[positions], causal_mask(positions, t)
            # packed documents: the layout of the whole sequences (gathered token ids), rows
            # of this rank's queries: tables (B, T / cp, rope_dim / 2), mask [B, 1, T / cp, T]
            with torch.no_grad():
                whole = gather_sequence(input_ids, self.cp_group)  # (B, T)
            view = DocumentView.of(self.documents, whole)
            cos, sin = rope_at(cos, sin, view.positions[:, positions])
            return cos, sin, view.mask[:, :, positions, :]
        cos, sin = self.rope(self.full_seq_len(h), h.device)  # each (T, rope_dim / 2), all T
        if self.documents is None or not self.documents.mask_attention or input_ids is None:
            return cos, sin, None
        view = DocumentView.of(self.documents, input_ids)
        cos, sin = rope_at(cos, sin, view.positions)  # each (B, T, rope_dim / 2)
        return cos, sin, view.mask

    def run_layers(
        self, h: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All decoder layers: h [B, T, H] -> (h [B, T, H], summed aux loss); input_ids
        [B, T] give the document boundaries when `documents` is set."""
        cos, sin, mask = self.attention_inputs(h, input_ids)
        aux = h.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            h, layer_aux = layer(h, cos, sin, mask)
            aux = aux + layer_aux
        return h, aux

    def document_labels(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None
    ) -> torch.Tensor | None:
        """labels [B, T] with those predicting across a document boundary ignored when
        `documents.mask_loss` (unchanged otherwise, and None stays None)."""
        if labels is None or self.documents is None:
            return labels
        return self.documents.labels(input_ids, labels)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h [B, T, H] -> logits [B, T, V / tp]."""
        return self.lm_head(self.norm(h))

    def head_and_loss(
        self, h: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Logits and, with labels [B, T], (mean CE over labels != -100, token count).

        With `recompute_head` (recompute "full") and labels, backward reruns the final norm,
        head and loss, so only h is kept: the [B, T, V / tp] logits and the loss's fp32
        softmax are the largest activations of a small model. The returned logits are then
        kept by nothing but the caller.
        """
        if labels is None:
            return self.logits(h), None, None
        return self.norm_head_loss(self.norm, h, labels)

    def norm_head_loss(
        self, norm: nn.Module, h: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`norm`, the LM head and the masked CE (recomputed in backward when
        `recompute_head`): h [B, T, H] (T / tp under SP), labels [B, T] -> (logits
        [B, T, V / tp], mean CE over labels != -100, token count)."""
        if self.recompute_head:
            return recomputed(self._norm_head_loss, norm, h, labels)
        return self._norm_head_loss(norm, h, labels)

    def _norm_head_loss(
        self, norm: nn.Module, h: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.lm_head(norm(h))  # (B, T, V / tp): h gathered along T first under SP
        loss, count = masked_mean_ce(logits, labels, self.tp_group, self.config.vocab_size)
        return logits, loss, count

    def _check_input(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)} (labels[:, t] is the target for position t)"
            )
        tp = tp_size_of(self.tp_group)
        if self.sequence_parallel and input_ids.shape[1] % tp != 0:
            raise ValueError(
                f"sequence parallelism splits the sequence over tp={tp} ranks, but its length "
                f"{input_ids.shape[1]} is not divisible by {tp}; use a seq_len that is a "
                "multiple of tp or turn sequence_parallel off"
            )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        """input_ids, labels: [B, T] int64 (labels already shifted; -100 = ignore)."""
        self._check_input(input_ids, labels)
        # (B, T, H), (B, T / tp, H) under SP
        h, aux = self.run_layers(self.embed(input_ids), input_ids)
        labels = self.document_labels(input_ids, labels)
        logits, loss, count = self.head_and_loss(h, labels)  # logits (B, T, V / tp)
        return ModelOutput(logits, loss, aux, None, total_loss(loss, aux), count)

    def indexed_moe_layers(self) -> list[tuple[int, DeepSeekMoE]]:
        """(global layer index, module) of every DeepSeekMoE: the main stack's layers, then
        MTP module d as index ``num_layers + d`` (d from 0)."""
        found = [(i, layer.mlp) for i, layer in enumerate(self.layers)]
        found += [
            (self.config.num_layers + d, m.block.mlp)
            for d, m in enumerate(getattr(self, "mtp", ()))
        ]
        return [(i, m) for i, m in found if isinstance(m, DeepSeekMoE)]

    def moe_layers(self) -> list[DeepSeekMoE]:
        """Every DeepSeekMoE module of the model (main stack first, then MTP blocks)."""
        return [m for _, m in self.indexed_moe_layers()]

    def balance_experts(self, reduce_fn: Any = None) -> MoEStats | None:
        """Aux-loss-free balancing step from the routing counted since the last call.

        Call once per optimizer step. reduce_fn: optional callable that sums a tensor across
        the processes holding other samples (data/expert parallel); None counts this process
        only. Under sequence parallelism the tensor-parallel ranks hold different tokens of the
        same samples: their counts are summed over `tp_group` first.
        Returns: the step's `MoEStats` (None for a dense model).
        """
        indexed = self.indexed_moe_layers()
        sequence_group = self.tp_group if self.sequence_parallel else None
        return moe_balance_step(
            [m for _, m in indexed],
            [i for i, _ in indexed],
            getattr(self.config, "bias_update_speed", 0.0),
            reduce_fn,
            sequence_group,
        )

    def update_router_biases(self, reduce_fn: Any = None) -> torch.Tensor:
        """`balance_experts`, returning only the loads [num_moe_layers, E] that drove the
        update ([0, 0] for dense)."""
        stats = self.balance_experts(reduce_fn)
        return torch.zeros(0, 0) if stats is None else stats.loads


class DenseTransformer(CausalLM):
    """Llama-style dense decoder (RMSNorm, rotate-half RoPE, GQA, SwiGLU)."""

    def __init__(
        self,
        config: DenseConfig,
        *,
        tp_group: Any = None,
        device: Any = None,
        sequence_parallel: bool = False,
        ep_group: Any = None,
        cp_group: Any = None,
    ):
        if not isinstance(config, DenseConfig):
            raise TypeError(f"DenseTransformer needs a DenseConfig, got {type(config).__name__}")
        super().__init__(
            config,
            tp_group=tp_group,
            device=device,
            sequence_parallel=sequence_parallel,
            ep_group=ep_group,
            cp_group=cp_group,
        )

    @property
    def rope_dim(self) -> int:
        return self.config.head_dim

    def make_layer(self, layer_idx: int, device: Any) -> DecoderLayer:
        c = self.config
        kw = {
            "tp_group": self.tp_group,
            "device": device,
            "sequence_parallel": self.sequence_parallel,
        }
        attn = DenseAttention(c, cp_group=self.cp_group, **kw)
        mlp = SwiGLU(c.hidden_size, c.intermediate_size, **kw)
        return DecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps, device)


def set_recompute(model: nn.Module, mode: str | None, full_layers: int = 0) -> int:
    """Set the recompute mode of every decoder layer in `model` (and, for "full", recompute the
    head and loss of the model or pipeline stage); returns how many layers were set.

    With `full_layers` N, the first N decoder layers of each pipeline chunk (of the model's
    layer stack when it is not split into stages) recompute "full" and the others `mode`, as
    Megatron-LM's ``--recompute-method block --recompute-num-layers N``; MTP blocks take `mode`.

    Raises:
        ValueError: for an unknown mode, or a negative or non-int `full_layers`.
    """
    check_recompute(mode)
    check_full_layers(full_layers, mode)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    first = {id(layer) for chunk in _layer_chunks(model) for layer in chunk[:full_layers]}
    for layer in layers:
        layer_mode = "full" if id(layer) in first else mode
        layer.recompute = layer_mode
        for m in layer.modules():  # the light mode's parts inside the layer
            if hasattr(m, "rebuild_activation"):  # SwiGLU MLPs and the routed experts
                m.rebuild_activation = layer_mode == "light"
            if hasattr(m, "rebuild_heads"):  # MLA's up-projections
                m.rebuild_heads = layer_mode == "light"
    models = [m for m in model.modules() if isinstance(m, CausalLM)]
    full = getattr(model, "full", None)  # a PipelineStage runs its head with the model's methods
    if isinstance(full, CausalLM):
        models.append(full)
    for m in models:
        m.recompute_head = mode == "full"
    return len(layers)


def _layer_chunks(model: nn.Module) -> list[list[nn.Module]]:
    """The main stack's decoder layers of each pipeline chunk of `model` (a `PipelineStage`:
    its chunks; a model: its layer list as one chunk)."""
    layers = getattr(model, "layers", None)
    chunks = getattr(model, "chunks", None)
    if isinstance(layers, nn.ModuleDict) and chunks is not None:
        return [[layers[str(i)] for i in chunk] for chunk in chunks]
    if isinstance(layers, nn.ModuleList):
        return [list(layers)]
    return []
