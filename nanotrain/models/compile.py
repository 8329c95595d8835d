"""torch.compile per decoder layer (`LanguageModelModule(compile_layers=True)`).

Each `DecoderLayer` is compiled in place (`nn.Module.compile`), so parameter names, state
dicts and checkpoints are unchanged and the embedding, the head and the pipeline executor stay
eager. A MoE layer with a capacity factor (fixed expert slots) is one graph; a dropless one
breaks the graph where the expert split sizes come to the host, and the parts around that
are compiled.
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
