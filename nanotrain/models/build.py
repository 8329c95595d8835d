"""`build_model` (meta-device construction, then materialize) and deterministic `init_weights`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanotrain.models.config import DeepSeekConfig, DenseConfig
from nanotrain.models.deepseek import DeepSeekV3
from nanotrain.models.transformer import CausalLM, DenseTransformer


def build_model(
    config: DenseConfig | DeepSeekConfig,
    mesh: Any = None,
    device: torch.device | str | None = None,
    *,
    generator: torch.Generator | None = None,
) -> CausalLM:
    """Build the model for `config`: `DeepSeekV3` or `DenseTransformer`.

    The model is always constructed on the meta device (instant, whatever its size). With
    device="meta" it is returned as is; otherwise it is materialized on `device` (default CPU)
    and initialized by `init_weights(model, generator)`, so the same RNG state (or generator
    seed) gives the same model.

    Args:
        config: DenseConfig or DeepSeekConfig.
        mesh: a ParallelMesh or None (one process); its `tp_group` splits heads and widths.
        device: "meta", "cpu", "cuda", ... (None = "cpu").
        generator: optional torch.Generator on `device` for the initialization.
    Raises:
        TypeError: for any other config type.
    """
    tp_group = getattr(mesh, "tp_group", None) if mesh is not None else None
    if isinstance(config, DeepSeekConfig):
        cls: type[CausalLM] = DeepSeekV3
    elif isinstance(config, DenseConfig):
        cls = DenseTransformer
    else:
        raise TypeError(
            f"build_model needs a DenseConfig or DeepSeekConfig, got {type(config).__name__}; "
            "use nanotrain.models.presets.get(name) to make one"
        )
    with torch.device("meta"):
        model = cls(config, tp_group=tp_group, device="meta")
    device = torch.device("cpu" if device is None else device)
    if device.type != "meta":
        model.to_empty(device=device)
        init_weights(model, generator)
    return model


@torch.no_grad()
def init_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """Initialize every parameter and buffer in module-definition order.

    Matrices and expert stacks (ndim >= 2, embedding included): normal(0, config.init_std);
    norm weights (ndim 1): ones; buffers (router bias, load counters): zeros.
    Tied weights are initialized once.

    Args:
        model: a built model with a `config` attribute.
        generator: optional torch.Generator (must live on the parameters' device);
            None uses the global RNG.
    """
    std = model.config.init_std
    for _, param in model.named_parameters():  # named_parameters skips tied duplicates
        if param.ndim >= 2:
            param.normal_(0.0, std, generator=generator)
        else:
            param.fill_(1.0)
    for _, buf in model.named_buffers():
        buf.zero_()
