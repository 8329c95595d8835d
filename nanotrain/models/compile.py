"""torch.compile of the model: per decoder layer (`compile_layers`) or whole (`compile_model`).

Both compile in place (`nn.Module.compile`), so parameter names, state dicts and checkpoints
are unchanged.

* `compile_layers` (`LanguageModelModule(compile_layers=True)`): each `DecoderLayer` is its
  own graph; the embedding, the head and the pipeline executor stay eager. Works under every
  layout, pipeline stages included. A MoE layer with a capacity factor (fixed expert slots) is
  one graph; a dropless one breaks the graph where the expert split sizes come to the host,
  and the parts around that are compiled.
* `compile_model` (`LanguageModelModule(compile_model=True)`): the whole forward (embedding,
  every layer, final norm, head and loss; MTP too) is one graph, so inductor also fuses across
  layer boundaries, plans one set of buffers for the whole step and compiles the loss's
  softmax. Not for a model split into pipeline stages (the schedule calls the stages piece by
  piece): there, use `compile_layers`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

CompileOption = bool | dict[str, Any]


def check_compile_options(layers: CompileOption, model: CompileOption, pp_size: int = 1) -> None:
    """Raise ValueError unless at most one of the two compile options is on, and
    `compile_model` only without pipeline stages (pp_size 1)."""
    for name, value in (("compile_layers", layers), ("compile_model", model)):
        if not isinstance(value, bool | dict):
            raise ValueError(
                f"{name} must be True, False or a dict of torch.compile arguments, got {value!r}"
            )
    if layers and model:
        raise ValueError(
            "compile_layers and compile_model are both set; choose one: compile_model compiles "
            "the whole model (layers included) as one graph, compile_layers each decoder layer"
        )
    if model and pp_size > 1:
        raise ValueError(
            f"compile_model compiles the whole model as one graph, but pp={pp_size} splits it "
            "into pipeline stages that the schedule runs piece by piece; use "
            "compile_layers=True instead (each decoder layer of each stage is compiled)"
        )


def compile_options(value: CompileOption) -> dict[str, Any]:
    """The `torch.compile` keyword arguments an option stands for (True: the defaults)."""
    return dict(value) if isinstance(value, dict) else {}


def compile_layers(model: nn.Module, **compile_kwargs: Any) -> int:
    """Compile every decoder layer of `model` in place; returns how many were compiled.

    `compile_kwargs` go to `torch.compile` (e.g. backend="aot_eager", mode="max-autotune").
    """
    from nanotrain.models.transformer import DecoderLayer

    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)


def compile_model(model: nn.Module, **compile_kwargs: Any) -> None:
    """Compile `model`'s whole forward in place (`compile_kwargs` go to `torch.compile`).

    A nanotrain model keeps its rotary tables on its device from here on
    (`CausalLM.keep_rope_tables`): built inside the graph, inductor would recompute them in
    every layer.
    """
    if hasattr(model, "keep_rope_tables"):
        model.keep_rope_tables()
    model.compile(**compile_kwargs)
