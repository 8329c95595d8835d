"""torch.compile per decoder layer (`LanguageModelModule(compile_layers=True)`).

Each `DecoderLayer` is compiled in place (`nn.Module.compile`), so parameter names, state
dicts and checkpoints are unchanged and the embedding, the head and the pipeline executor stay
eager. Inside a MoE layer the data-dependent parts (the expert split sizes) break the graph
and run eagerly; the dense parts around them are compiled.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def compile_layers(model: nn.Module, **compile_kwargs: Any) -> int:
    """Compile every decoder layer of `model` in place; returns how many were compiled.

    `compile_kwargs` go to `torch.compile` (e.g. backend="aot_eager", mode="max-autotune").
    """
    from nanotrain.models.transformer import DecoderLayer

    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)
