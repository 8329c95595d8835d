"""MoELoadMonitor: per-layer expert load balance, dropped tokens, router biases and a heatmap."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from nanotrain.callbacks.base import Callback
from nanotrain.models.balance import MoEStats

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.strategies.base import StepOutput
    from nanotrain.trainer import Trainer

HEATMAP_TAG = "moe/load_heatmap"
# Load / mean load at which the heatmap's red saturates: twice the fair share is already
# badly unbalanced, and a fixed scale keeps heatmaps of different steps comparable.
HEATMAP_SATURATION = 2.0
_IDLE_RGB = (0.23, 0.30, 0.75)  # blue: the expert got (almost) nothing
_OVERLOADED_RGB = (0.71, 0.02, 0.15)  # red: HEATMAP_SATURATION × its share or more
# Small heatmaps (a tiny model's 2 × 8) are scaled up by an integer factor so they are
# visible in TensorBoard, until the longer side reaches this many pixels.
HEATMAP_MIN_PIXELS = 256


def moe_load_metrics(stats: MoEStats, per_expert: bool = False) -> dict[str, float]:
    """The scalars MoELoadMonitor logs for one step's `stats` (L MoE layers, E experts).

    Per layer l (its global decoder-layer index, `stats.layers`), with load = token copies
    routed to each expert (`stats.loads[l]`, [E]) and mean = its mean over the E experts:

    - `moe/layer{l}/max_over_mean` = max load / mean, `moe/layer{l}/min_over_mean` = min
      load / mean (1.0 and 1.0 when perfectly balanced; left out for a layer that received
      no tokens, where the ratio is undefined);
    - `moe/layer{l}/dropped_fraction` = dropped / (routed + dropped), where routed = the sum
      of the layer's loads and dropped = the copies the capacity limit discarded: the
      fraction of (token, chosen expert) pairs that never reached their expert (0 when
      dropless or when the layer saw nothing);
    - `moe/layer{l}/bias_abs_max` = the largest |routing bias| of the layer;
    - with `per_expert`: `moe/layer{l}/load/expert{e}` = load of expert e.

    Model-wide: `moe/max_over_mean`, the mean of the per-layer max_over_mean values.

    Args:
        stats: loads [L, E], dropped [L], biases [L, E] and the L layer indices.
        per_expert: also return every expert's load (L × E scalars).

    Returns:
        Metric name → value (Python floats; the tensors are read to the host once each).
    """
    loads = stats.loads.detach().double().cpu()  # (L, E)
    mean = loads.mean(dim=-1)  # (L,)
    routed = loads.sum(dim=-1)  # (L,)
    dropped = stats.dropped.detach().double().cpu().reshape(-1)  # (L,)
    rows = zip(
        stats.layers,
        loads.max(dim=-1).values.tolist(),
        loads.min(dim=-1).values.tolist(),
        mean.tolist(),
        routed.tolist(),
        dropped.tolist(),
        stats.biases.detach().float().abs().amax(dim=-1).cpu().tolist(),
        strict=True,
    )
    metrics: dict[str, float] = {}
    ratios: list[float] = []
    for layer, high, low, avg, num_routed, num_dropped, bias in rows:
        prefix = f"moe/layer{layer}"
        if avg > 0:
            ratios.append(high / avg)
            metrics[f"{prefix}/max_over_mean"] = high / avg
            metrics[f"{prefix}/min_over_mean"] = low / avg
        total = num_routed + num_dropped
        metrics[f"{prefix}/dropped_fraction"] = num_dropped / total if total > 0 else 0.0
        metrics[f"{prefix}/bias_abs_max"] = bias
    if per_expert:
        for layer, row in zip(stats.layers, loads.tolist(), strict=True):
            for expert, load in enumerate(row):
                metrics[f"moe/layer{layer}/load/expert{expert}"] = load
    if ratios:
        metrics["moe/max_over_mean"] = math.fsum(ratios) / len(ratios)
    return metrics


def load_heatmap(loads: torch.Tensor) -> torch.Tensor:
    """An RGB image of relative expert load: one row per MoE layer, one column per expert.

    Each cell shows load / the layer's mean load on a blue–white–red scale: white = exactly
    the fair share (1.0), fully blue = no tokens (0), fully red = `HEATMAP_SATURATION` × the
    share or more; in between the colour is interpolated linearly. A layer with no tokens at
    all is white. Cells are enlarged to square blocks of `scale` pixels, where `scale` is the
    largest integer with max(L, E) × scale ≤ `HEATMAP_MIN_PIXELS` (at least 1).

    Args:
        loads: [L, E] token copies per expert (any real dtype, any device).

    Returns:
        uint8 [3, L × scale, E × scale] (CHW, as `SummaryWriter.add_image` takes it).

    Raises:
        ValueError: if `loads` is not a non-empty 2-D tensor.
    """
    if loads.dim() != 2 or loads.numel() == 0:
        raise ValueError(f"loads must be a non-empty [layers, experts] tensor, got {loads.shape}")
    loads = loads.detach().double().cpu()
    mean = loads.mean(dim=-1, keepdim=True)  # (L, 1)
    ratio = torch.where(mean > 0, loads / mean.clamp_min(1e-300), torch.ones_like(loads))
    # signed distance from the fair share: -1 = idle, 0 = balanced, +1 = saturated
    offset = ((ratio - 1.0) / (HEATMAP_SATURATION - 1.0)).clamp(-1.0, 1.0)
    idle = torch.tensor(_IDLE_RGB, dtype=torch.float64)
    hot = torch.tensor(_OVERLOADED_RGB, dtype=torch.float64)
    target = torch.where((offset < 0).unsqueeze(-1), idle, hot)  # (L, E, 3)
    rgb = 1.0 + offset.abs().unsqueeze(-1) * (target - 1.0)  # lerp from white, (L, E, 3)
    scale = max(1, HEATMAP_MIN_PIXELS // max(loads.shape))
    rgb = rgb.repeat_interleave(scale, dim=0).repeat_interleave(scale, dim=1)
    return (rgb * 255).round().to(torch.uint8).permute(2, 0, 1).contiguous()  # (3, H, W)


def merge_stage_stats(parts: list[MoEStats | None]) -> MoEStats | None:
    """Join the MoE statistics of several pipeline stages into one, ordered by layer index.

    Stages without MoE layers (None, or zero layers) are skipped; None when none has any.
    Tensors are moved to the CPU.
    """
    present = [p for p in parts if p is not None and len(p.layers) > 0]
    if not present:
        return None
    layers = [layer for p in present for layer in p.layers]
    order = sorted(range(len(layers)), key=layers.__getitem__)
    index = torch.tensor(order, dtype=torch.long)
    return MoEStats(
        layers=[layers[i] for i in order],
        loads=torch.cat([p.loads.detach().cpu() for p in present])[index],
        dropped=torch.cat([p.dropped.detach().cpu().reshape(-1) for p in present])[index],
        biases=torch.cat([p.biases.detach().cpu() for p in present])[index],
    )


class MoELoadMonitor(Callback):
    """Logs how evenly the routed experts of every MoE layer share the tokens.

    Reads `module.last_moe_stats` (a `MoEStats` of the step that just finished: expert loads
    and dropped tokens summed over all ranks, router biases after the step's update) at
    `on_train_step_end`, at the step's `trainer.logged_step` (Lightning's 0-based step, as
    its `train/loss`); cadences count `trainer.global_step`. Scalars (see `moe_load_metrics`), every
    `log_every_n_steps`: `moe/layer{l}/max_over_mean`, `.../min_over_mean`,
    `.../dropped_fraction`, `.../bias_abs_max`, optionally `.../load/expert{e}`, and
    `moe/max_over_mean` (the mean over layers). Every `heatmap_every_n_steps`: the image
    `moe/load_heatmap` (see `load_heatmap`) to every logger whose `experiment` has
    `add_image` (TensorBoard); other loggers are skipped.

    Under pipeline parallelism each stage holds different MoE layers: on a step that logs
    anything, every rank gathers all stages' statistics with
    `strategy.gather_from_stages` (one small object gather over the pipeline group, entered by
    every rank on the same steps), so rank 0 logs every layer. Without MoE layers (`last_moe_stats` missing or None on every stage) nothing is
    logged.

    Args:
        log_every_n_steps: cadence of the scalars; None uses the Trainer's.
        heatmap_every_n_steps: cadence of the heatmap image; 0 = never.
        per_expert: also log each expert's load (L × E scalars: off by default, since a
            large model has thousands).

    Raises:
        ValueError: for a non-positive `log_every_n_steps` or a negative heatmap cadence.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        heatmap_every_n_steps: int = 100,
        per_expert: bool = False,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be positive or None, got {log_every_n_steps}")
        if heatmap_every_n_steps < 0:
            raise ValueError(
                f"heatmap_every_n_steps must be >= 0 (0 disables it), got {heatmap_every_n_steps}"
            )
        self.log_every_n_steps = log_every_n_steps
        self.heatmap_every_n_steps = heatmap_every_n_steps
        self.per_expert = per_expert

    def on_train_step_end(
        self,
        trainer: Trainer,
        module: NanoModule,
        outputs: StepOutput,
        microbatches: list[Any],
        step_idx: int,
    ) -> None:
        """On log / heatmap steps: gather the stages' statistics, log scalars and the image."""
        step = trainer.global_step  # already counts the step that just finished
        every = self.log_every_n_steps or trainer.settings.log_every_n_steps
        log_now = step % every == 0
        heatmap_now = bool(self.heatmap_every_n_steps) and step % self.heatmap_every_n_steps == 0
        if not (log_now or heatmap_now):
            return
        # Decided from the step number alone, never from this rank's stats, so every rank
        # enters the (pipeline) gather on the same steps.
        local = getattr(module, "last_moe_stats", None)
        local = None if local is None else merge_stage_stats([local])  # CPU copy, pickles small
        stats = merge_stage_stats(trainer.strategy.gather_from_stages(local))
        if stats is None:
            return  # a dense model
        if log_now:
            trainer.log_metrics(moe_load_metrics(stats, self.per_expert), step=trainer.logged_step)
        if heatmap_now:
            self._write_heatmap(trainer, stats, trainer.logged_step)

    @staticmethod
    def _write_heatmap(trainer: Trainer, stats: MoEStats, step: int) -> None:
        # Loggers exist on rank 0 only, so other ranks build no image.
        writers = [
            lg.experiment
            for lg in trainer.loggers.loggers
            if hasattr(getattr(lg, "experiment", None), "add_image")
        ]
        if not writers:
            return
        image = load_heatmap(stats.loads)
        for writer in writers:
            writer.add_image(HEATMAP_TAG, image, global_step=step, dataformats="CHW")
