"""What `LanguageModelModule` does per batch: the forward (with its token-id check), the
training and validation steps, the loss terms and the counts each averages over, and the
hooks around them (perplexity, per-part validation losses, router balancing)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from nanotrain.loss_terms import LossTerms
from nanotrain.models.documents import IGNORE_INDEX, shift_left
from nanotrain.parallel.context import on_whole_sequence


class LanguageModelSteps:
    """Mixin of `nanotrain.LanguageModelModule`: its forward, steps and loss accounting. It
    reads the module's `model`, `config`, `documents` and `_datamodule()`."""

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        # Reading min/max waits for the device, so under a Trainer the ids are checked on the
        # first step and on logging steps only (a vocabulary mismatch shows on every batch);
        # the other steps stay free of host syncs (docs/performance.md).
        trainer = self._nano_trainer
        if trainer is not None and self.training:
            step = trainer.global_step + 1  # the step being computed
            if step != 1 and step % trainer.settings.log_every_n_steps != 0:
                return
        vocab = self.config.vocab_size
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(
                f"token ids must lie in [0, {vocab}) but the batch has ids in "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]; the data was tokenized with "
                "a larger vocabulary than the model's vocab_size"
            )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        """input_ids/labels [B, T] → the model's output (logits, loss, aux_loss, mtp_loss...)."""
        self._check_ids(input_ids)
        if not self._cuda_graphs:
            return self.model(input_ids, labels)
        # every microbatch is a new replay of the graphs; the losses are read after the next
        # replay has reused the graphs' output memory, so they are copied out of it
        torch.compiler.cudagraph_mark_step_begin()
        out = self.model(input_ids, labels)
        copies = {
            name: value.clone()
            for name in ("loss", "aux_loss", "mtp_loss", "total_loss", "num_tokens", "mtp_losses")
            if isinstance(value := getattr(out, name, None), torch.Tensor)
        }
        return dataclasses.replace(out, **copies)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        """One microbatch: under the nanotrain Trainer ``{"loss": loss + aux_loss +
        λ·mtp_loss, "loss_terms": LossTerms}`` (the strategy averages each term over its own
        global count and logs the global means, see `loss_counts`); elsewhere (Lightning) the
        total loss, with each term logged.

        Under pipeline parallelism the schedule first runs it once per model chunk: the stage
        model then returns a partial `StageOutput` (this chunk's activation and its share of
        the loss terms), handed back with ``"stage_output"`` as well."""
        out = self(batch["input_ids"], batch["labels"])
        partial = getattr(out, "partial", False)
        if self._nano_trainer is not None:
            result = {"loss": out.total_loss, "loss_terms": self._loss_terms(out)}
            if partial:
                result["stage_output"] = out
            return result
        if partial:
            return {"loss": out.total_loss, "stage_output": out}
        tokens = self.count_tokens(batch)
        self.log("train/lm_loss", out.loss.detach(), batch_size=tokens)
        self.log("train/aux_loss", out.aux_loss.detach(), batch_size=tokens)
        if out.mtp_loss is not None:
            self.log("train/mtp_loss", out.mtp_loss.detach(), batch_size=tokens)
        return out.total_loss

    def _mtp_depth(self) -> int:
        return int(getattr(self.config, "mtp_depth", 0) or 0)

    def loss_counts(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """What each loss term of one microbatch averages over, [2 + D] int64 on the
        labels' device: tokens with a label (LM loss), sequences (the sequence-wise balance
        loss of every MoE layer), then per MTP depth k = 1..D its targets (labels k positions
        further on). None outside the nanotrain Trainer (the whole loss is then weighed by
        tokens)."""
        if self._nano_trainer is None:
            return None
        labels = batch["labels"]
        live = self._labels(batch) != IGNORE_INDEX
        sequences = torch.full((), live.shape[0], dtype=torch.long, device=live.device)
        counts = [live.sum(), sequences]
        documents = self.documents
        # under context parallelism the targets come from the whole sequences (each rank
        # counts those at its own positions)
        cp_group = getattr(self.mesh, "cp_group", None)
        for k in range(1, self._mtp_depth() + 1):

            def targets(ids: torch.Tensor, lab: torch.Tensor, k: int = k) -> torch.Tensor:
                if documents is None:
                    return shift_left(lab, k, IGNORE_INDEX)
                return documents.mtp_targets(ids, lab, k)

            target = on_whole_sequence(targets, (batch["input_ids"], labels), cp_group)
            counts.append((target != IGNORE_INDEX).sum())
        return torch.stack(counts)

    def _labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's labels as the model's loss reads them (cross-boundary ones ignored
        under `eod_mask_loss`)."""
        if self.documents is None:
            return batch["labels"]
        return self.documents.labels(batch["input_ids"], batch["labels"])

    def _loss_terms(self, out: Any) -> LossTerms:
        """The [2 + D] terms of `loss_counts` from a model (or pipeline stage) output: this
        microbatch's means, 0 for terms another pipeline stage computes."""
        depth = self._mtp_depth()
        zero = out.aux_loss.new_zeros(())
        lm = out.loss if out.loss is not None else zero
        mtp = out.mtp_losses if out.mtp_losses is not None else zero.expand(depth)
        values = torch.cat([torch.stack([lm.float(), out.aux_loss.float()]), mtp.float()])
        weight = getattr(self.config, "mtp_loss_weight", 0.0)
        weights = [1.0, 1.0] + [weight / max(depth, 1)] * depth
        names = ["train/lm_loss", "train/aux_loss"] + ["train/mtp_loss"] * depth
        return LossTerms(values, weights, names)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Logs val/loss (token-weighted over the whole validation set), val/ppl, val/bpb.
        A pipeline chunk's partial output is handed back unlogged, as in `training_step`."""
        out = self(batch["input_ids"], batch["labels"])
        if getattr(out, "partial", False):
            return {"loss": out.total_loss, "stage_output": out}
        tokens = int(self.count_tokens(batch))
        self.log("val/loss", out.loss, sync_dist=True, batch_size=tokens, prog_bar=True)
        self._log_part_losses(batch, out.loss, tokens)
        bytes_per_token = getattr(self._datamodule(), "bytes_per_token", None)
        if bytes_per_token:
            bpb = out.loss / math.log(2) / bytes_per_token
            self.log("val/bpb", bpb, sync_dist=True, batch_size=tokens)
        return out.loss

    def _log_part_losses(self, batch: dict[str, torch.Tensor], loss: torch.Tensor, tokens: int):
        """A blend's validation batch (``"part"``, one part per batch: `TokenDataModule`) logs
        ``val/loss/<name>`` for every part, weighted by its tokens in this batch (0 for the
        other parts), so every rank logs the same names and each mean is over its part's
        tokens alone."""
        names = getattr(self._datamodule(), "part_names", None)
        if "part" not in batch or not names:
            return
        part = batch["part"]
        if bool((part != part[0]).any()):
            raise ValueError(
                "a validation batch mixes parts of the blend; per-part losses need one part "
                "per batch: use TokenDataModule's val_dataloader (it pads each part to a "
                "multiple of micro batch × data-parallel size)"
            )
        k = int(part[0])
        for i, name in enumerate(names):
            weight = tokens if i == k else 0
            self.log(f"val/loss/{name}", loss, sync_dist=True, batch_size=weight)

    def on_validation_epoch_end(self) -> None:
        """Perplexity from the averaged loss (a mean of per-batch perplexities would be wrong)."""
        trainer = self._nano_trainer
        if trainer is not None and "val/loss" in trainer.callback_metrics:
            trainer.log_metrics({"val/ppl": torch.exp(trainer.callback_metrics["val/loss"])})

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Aux-loss-free balancing: move router biases by the step's expert loads over all
        ranks (the strategy sums them) and keep the step's `MoEStats` as `last_moe_stats`
        (None for dense models) for `MoELoadMonitor`, which logs the load statistics of every
        MoE layer (all pipeline stages). Also adds `train/bpb` (the step's global LM loss in
        bits per byte) to the step's metrics when the data knows its bytes per token.

        Done here rather than at batch end so that a checkpoint saved at the end of this step
        (callbacks run before the module's hooks) already holds the updated biases. The bias
        only steers the next forward's routing, so updating it before the optimizer step
        changes nothing else. Loads and dropped copies are summed in one collective."""
        trainer = self._nano_trainer
        reduce_fn = None if trainer is None else (lambda t: trainer.strategy.reduce(t, "sum"))
        self.last_moe_stats = self.model.balance_experts(reduce_fn)
        out = None if trainer is None else getattr(trainer, "step_output", None)
        bytes_per_token = getattr(self._datamodule(), "bytes_per_token", None)
        if out is not None and bytes_per_token and "train/lm_loss" in out.metrics:
            out.metrics["train/bpb"] = out.metrics["train/lm_loss"] / math.log(2) / bytes_per_token

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tokens that carry a loss in one microbatch (labels != -100, after `eod_mask_loss`),
        as a 0-dim int64 tensor on the labels' device (counting reads nothing back to the
        host)."""
        return (self._labels(batch) != IGNORE_INDEX).sum()
