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
  softmax. An MoE layer under recompute "full" runs eagerly between graphs: its checkpointed
  region updates the load counter, which dynamo does not trace inside a checkpoint. Not for a model split into pipeline stages (the schedule calls the stages piece by
  piece): there, use `compile_layers`.
* CUDA graphs (`compile_model={"mode": "reduce-overhead"}`): the compiled graphs are captured
  once and replayed, so a host-bound step (many small kernels: MoE routing, dispatch) costs
  its kernel time. `LanguageModelModule` marks each microbatch as a new graph step
  (`torch.compiler.cudagraph_mark_step_begin`) and refuses, at fit start, strategies that
  cannot replay graphs (`Strategy.cuda_graphs_refusal`: CPU devices, DDP, several processes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanotrain.parallel.schedules import splits_backward

CompileOption = bool | dict[str, Any]


def check_compile_options(
    layers: CompileOption, model: CompileOption, pp_size: int = 1, schedule: str | None = None
) -> None:
    """Raise ValueError unless at most one of the two compile options is on, `compile_model`
    only without pipeline stages (pp_size 1), and neither under a pipeline `schedule` that
    splits backwards (a compiled region's backward is one piece that runs once)."""
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
    if (layers or model) and splits_backward(schedule, pp_size):
        raise ValueError(
            f"schedule={schedule!r} splits backwards into an input half and a weight half, but "
            "a compiled layer's backward is one piece that runs once (torch.compile donates "
            "its buffers); use schedule='1f1b' with compile_layers, or compile_layers=False"
        )


#: torch.compile modes whose compiled graphs are replayed as CUDA graphs
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cuda_graphs(*options: CompileOption) -> bool:
    """Whether any compile option asks for CUDA graphs (a mode in `CUDA_GRAPH_MODES`, or
    inductor's ``triton.cudagraphs`` option)."""
    for value in options:
        kwargs = compile_options(value) if value else {}
        if kwargs.get("mode") in CUDA_GRAPH_MODES:
            return True
        if (kwargs.get("options") or {}).get("triton.cudagraphs"):
            return True
    return False


def compile_options(value: CompileOption) -> dict[str, Any]:
    """The `torch.compile` keyword arguments an option stands for (True: the defaults)."""
    return dict(value) if isinstance(value, dict) else {}


def compile_layers(model: nn.Module, **compile_kwargs: Any) -> int:
    """Compile every decoder layer of `model` in place; returns how many were compiled.

    `compile_kwargs` go to `torch.compile` (e.g. backend="aot_eager", mode="max-autotune").
    """
    from nanotrain.models.transformer import DecoderLayer

    key_inductor_caches_by_cpu_isa(compile_kwargs)
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
    key_inductor_caches_by_cpu_isa(compile_kwargs)
    model.compile(**compile_kwargs)


#: the part of `torch.compiler.config.cache_key_tag` that `key_inductor_caches_by_cpu_isa` owns
CPU_ISA_TAG = "nanotrain-cpu-vec-isa="


def key_inductor_caches_by_cpu_isa(compile_kwargs: dict[str, Any]) -> None:
    """Put the CPU vector ISA inductor generates code for into its on-disk cache keys (for
    the inductor backend; other backends generate no C++).

    Works around a torch bug (torch 2.13): the FX graph and AOTAutograd cache keys leave out
    that ISA (chosen by `ATEN_CPU_CAPABILITY`, else the machine's best). A graph cached by a
    process on AVX512 holds loops that step 16 floats; a later process under
    `ATEN_CPU_CAPABILITY=avx2` (or on an AVX2-only host sharing the cache directory) loads
    that source and builds it for 8-float AVX2 vectors, so kernels leave half their outputs
    unwritten and read past their inputs: NaN or huge losses that vary from run to run.
    `torch.compiler.config.cache_key_tag` is hashed into both keys; this appends
    ``nanotrain-cpu-vec-isa=<isa>`` (replacing an earlier one, keeping the user's tag).
    """
    if compile_kwargs.get("backend", "inductor") != "inductor":
        return
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    parts = [p for p in torch.compiler.config.cache_key_tag.split(";") if p]
    parts = [p for p in parts if not p.startswith(CPU_ISA_TAG)]
    parts.append(f"{CPU_ISA_TAG}{pick_vec_isa()}")
    torch.compiler.config.cache_key_tag = ";".join(parts)
