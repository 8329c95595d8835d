"""DeepSeek-V3: MLA attention, DeepSeekMoE layers (after the first k dense ones) and MTP.

Multi-token prediction (DeepSeek-V3 section 2.2), depth k = 1..D, position i:
    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]     (eh_proj, [H, 2H])
    h^k    = TRM_k(h'^k)                                          (one decoder layer)
    P^k_{i+k+1} = OutHead(RMSNorm(h^k_i))                         (shared lm_head)
h^0 is the main stack's last hidden state (before the final norm). The embedding and output
head are the main model's own modules (shared, not copied). The paper writes the concatenation
as [h; Emb]; the released V3 weights (and HF) put the embedding half first, which we follow so
`eh_proj` loads unchanged.

Shape comments: B batch, T sequence, H hidden, D the MTP depth (`mtp_depth`). Under sequence
parallelism the hidden states and embeddings are (B, T / tp, H) on each rank; the rotary
tables still cover all T positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanotrain.models.attention import MLAttention
from nanotrain.models.config import DeepSeekConfig
from nanotrain.models.documents import IGNORE_INDEX, shift_left
from nanotrain.models.layers import RMSNorm, SwiGLU
from nanotrain.models.moe import DeepSeekMoE
from nanotrain.models.transformer import (
    CausalLM,
    DecoderLayer,
    ModelOutput,
    total_loss,
)
from nanotrain.parallel.context import on_whole_sequence
from nanotrain.parallel.tensor import ColumnParallelLinear


def make_deepseek_layer(
    config: DeepSeekConfig,
    moe: bool,
    *,
    tp_group: Any,
    device: Any,
    sequence_parallel: bool = False,
    ep_group: Any = None,
    cp_group: Any = None,
) -> DecoderLayer:
    """One DeepSeek decoder layer: MLA + (DeepSeekMoE if `moe` else dense SwiGLU); `ep_group`
    splits the routed experts of a MoE layer (None: this rank holds them all); `cp_group`
    holds the other parts of each sequence (context parallelism)."""
    c = config
    kw = {"tp_group": tp_group, "device": device, "sequence_parallel": sequence_parallel}
    attn = MLAttention(c, cp_group=cp_group, **kw)
    if moe:
        mlp: nn.Module = DeepSeekMoE(c, ep_group=ep_group, cp_group=cp_group, **kw)
    else:
        mlp = SwiGLU(c.hidden_size, c.intermediate_size, **kw)
    return DecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps, device)


class MTPModule(nn.Module):
    """One MTP depth: norms, the [2H -> H] projection and one decoder layer.

    Shapes: forward(h_prev [B, T, H], emb_next [B, T, H], cos, sin, mask=None) -> (h [B, T, H],
    aux); cos, sin and the optional block-causal mask as `DecoderLayer` takes them.
    The caller applies `norm` and the shared head. Under sequence parallelism every tensor is
    [B, T / tp, H]; the norms and `eh_proj` (replicated) run on this rank's tokens.
    """

    def __init__(
        self,
        config: DeepSeekConfig,
        *,
        tp_group: Any,
        device: Any,
        sequence_parallel: bool = False,
        ep_group: Any = None,
        cp_group: Any = None,
    ):
        super().__init__()
        c = config
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
        # replicated over tp: its output feeds the block's (replicated) residual stream
        self.eh_proj = ColumnParallelLinear(2 * c.hidden_size, c.hidden_size, device=device)
        # V3's MTP block has the same shape as a main-stack MoE layer
        moe = c.first_k_dense_replace < c.num_layers
        self.block = make_deepseek_layer(
            c,
            moe,
            tp_group=tp_group,
            device=device,
            sequence_parallel=sequence_parallel,
            ep_group=ep_group,
            cp_group=cp_group,
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)

    def forward(
        self,
        h_prev: torch.Tensor,
        emb_next: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]: (B, T, 2H), projected to (B, T, H)
        x = self.eh_proj(torch.cat((self.enorm(emb_next), self.hnorm(h_prev)), dim=-1))
        return self.block(x, cos, sin, mask)


class DeepSeekV3(CausalLM):
    """DeepSeek-V3 family model (also covers V2-style configs: softmax routing, no q_lora).

    forward(input_ids, labels) runs the MTP modules only when labels are given and the model
    is in training mode or `run_mtp=True`; inference skips them. `ep_group` splits the routed
    experts of every MoE layer, MTP blocks included (see `DeepSeekMoE`).
    """

    def __init__(
        self,
        config: DeepSeekConfig,
        *,
        tp_group: Any = None,
        device: Any = None,
        sequence_parallel: bool = False,
        ep_group: Any = None,
        cp_group: Any = None,
    ):
        if not isinstance(config, DeepSeekConfig):
            raise TypeError(f"DeepSeekV3 needs a DeepSeekConfig, got {type(config).__name__}")
        kw = {
            "tp_group": tp_group,
            "device": device,
            "sequence_parallel": sequence_parallel,
            "ep_group": ep_group,
            "cp_group": cp_group,
        }
        super().__init__(config, **kw)
        self.mtp = nn.ModuleList(MTPModule(config, **kw) for _ in range(config.mtp_depth))

    @property
    def rope_dim(self) -> int:
        return self.config.qk_rope_head_dim

    def make_layer(self, layer_idx: int, device: Any) -> DecoderLayer:
        moe = self.config.is_moe_layer(layer_idx)
        return make_deepseek_layer(
            self.config,
            moe,
            tp_group=self.tp_group,
            device=device,
            sequence_parallel=self.sequence_parallel,
            ep_group=self.ep_group,
            cp_group=self.cp_group,
        )

    def mtp_losses(
        self, h: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each MTP depth's cross-entropy [D] (a mean over that depth's targets) and the MTP
        blocks' summed aux loss.

        Depth k (1-based) at position t reads token t+k (input_ids shifted left by k) and
        predicts token t+k+1 (labels shifted left by k); the last k positions have no target.
        With `documents` the blocks attend within position t's document (as the main stack)
        and, with its `mask_loss`, targets in a later document than t are ignored.

        Under context parallelism (T: this rank's two chunks) the shifted ids and targets are
        taken from the whole sequences (`on_whole_sequence`), so a chunk's last positions
        read the tokens that follow it on another rank.

        Args: h [B, T, H] ([B, T / tp, H] under sequence parallelism) main-stack output before
        the final norm; input_ids, labels [B, T].
        """
        cos, sin, mask = self.attention_inputs(h, input_ids)  # as the main stack's layers
        cp = self.cp_group
        losses, aux = [], h.new_zeros((), dtype=torch.float32)
        for k, module in enumerate(self.mtp, start=1):
            ids_next = on_whole_sequence(lambda ids, k=k: shift_left(ids, k, 0), (input_ids,), cp)
            emb_next = self.embed(ids_next)  # (B, T, H): Emb(token t+k)
            h, block_aux = module(h, emb_next, cos, sin, mask)
            target = self.mtp_targets(input_ids, labels, k)  # (B, T): token t+k+1 or -100
            _, loss, _ = self.norm_head_loss(module.norm, h, target)  # logits dropped here
            losses.append(loss)
            aux = aux + block_aux
        return torch.stack(losses), aux

    def mtp_targets(self, input_ids: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
        """MTP depth k's targets [B, T]: labels [B, T] shifted left by k (-100 in the last k),
        with cross-document targets ignored under `documents.mask_loss` (from the whole
        sequences under context parallelism)."""
        documents = self.documents

        def targets(ids: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
            if documents is None:
                return shift_left(lab, k, IGNORE_INDEX)
            return documents.mtp_targets(ids, lab, k)

        return on_whole_sequence(targets, (input_ids, labels), self.cp_group)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        run_mtp: bool | None = None,
    ) -> ModelOutput:
        """input_ids, labels: [B, T] int64 (labels already shifted; -100 = ignore).

        run_mtp: None = run the MTP modules when training with labels; False skips them.
        """
        self._check_input(input_ids, labels)
        h, aux = self.run_layers(self.embed(input_ids), input_ids)
        logits, loss, count = self.head_and_loss(h, self.document_labels(input_ids, labels))
        if run_mtp is None:
            run_mtp = self.training
        mtp_loss = per_depth = None
        if labels is not None and run_mtp and len(self.mtp) > 0:
            per_depth, mtp_aux = self.mtp_losses(h, input_ids, labels)  # (D,), scalar
            mtp_loss = per_depth.mean()
            aux = aux + mtp_aux
        total = total_loss(loss, aux, mtp_loss, self.config.mtp_loss_weight)
        return ModelOutput(logits, loss, aux, mtp_loss, total, count, per_depth)
