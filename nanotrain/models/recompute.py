"""Activation recomputation: keep fewer activations in forward, recompute them in backward.

Modes, set per decoder layer (`set_recompute`, or `LanguageModelModule(recompute=...)`):

* ``None``: keep every activation (fastest, most memory).
* ``"full"``: keep only each decoder layer's input; backward reruns the whole layer (norms,
  attention, MLP or MoE with its dispatch and all-to-alls) before differentiating it. About one
  extra forward per step; activation memory per layer drops to one [B, T, H] tensor. The final
  norm, LM head and cross-entropy of the main model and of each MTP depth are recomputed too
  (`CausalLM.norm_head_loss`): their [B, T, V] logits and fp32 softmax would otherwise outweigh
  all the layers of a small model.
* ``"selective"``: recompute the attention block only (`self_attn`: the q/kv projections incl.
  MLA's low-rank up-projections, rotary embedding and the attention core), keeping the MLP/MoE
  activations. Attention's per-head q/k/v tensors are large next to its FLOPs, so this saves
  much of the memory for little extra compute (the idea behind Megatron's selective recompute).

* ``"light"``: recompute only what is cheap to make again, as DeepSeek-V3 does (report,
  section 3.2.3; Megatron-Core's ``--recompute-modules layernorm mla_up_proj moe_act``): each
  decoder layer's two RMSNorms (their outputs, and the copies the next matmuls make of them,
  are rebuilt from the norm's input), MLA's up-projections with RoPE (the per-head q, k and v
  the attention core saves are rebuilt from the latents), and the SwiGLU activation of every
  MLP and expert (silu(gate) and the product are rebuilt from gate and up). Everything else
  is kept; no collective runs again. The up-projections run twice more in backward: once to
  rebuild what the attention core saved, once for their own gradients.

Recomputation reruns the same collectives in the same order on every rank (tensor, sequence
and expert parallelism), so it composes with every MegatronStrategy layout and pipeline
schedule. Side effects of a forward are not repeated: `is_recomputing()` is true while a
recompute runs, and the MoE load counters skip it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from nanotrain.parallel.saved_rebuild import RebuiltSaves

#: accepted recompute modes
RECOMPUTE_MODES = (None, "full", "selective", "light")
# per thread: a backward running on another thread (the pipeline executor's paired chunks)
# reruns its forwards while this thread's forward must still count its side effects
_state = threading.local()


def is_recomputing() -> bool:
    """True while backward reruns a checkpointed forward on this thread (side effects must
    not repeat)."""
    return getattr(_state, "depth", 0) > 0


class _RecomputeScope:
    """Marks a rerun of a checkpointed forward (`is_recomputing`). A class, not a generator:
    backward may rerun a region more than once (a split backward's weight half unpacks what
    its input half already used), and each rerun enters the same object again."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1


def _contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), _RecomputeScope()


def recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` without keeping its activations when autograd records; else a plain call."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if torch.compiler.is_compiling():
        # torch.compile turns the region into a graph whose backward recomputes it, and it
        # takes no context_fn but its own selective-recompute modes. A region that updates a
        # buffer (an MoE layer's load count under "full") is not traced: dynamo breaks the
        # graph around it and runs it eagerly, through the branch below
        return checkpoint(fn, *args, use_reentrant=False)
    return checkpoint(_without_cast_cache(fn), *args, use_reentrant=False, context_fn=_contexts)


def _without_cast_cache(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with autocast's weight-cast cache off: a recomputed region keeps no weight copy
    for the step (`nanotrain.models.cast_cache`), in its forward as in its rerun; it casts
    afresh each time, as it keeps nothing else."""

    def run(*args: Any) -> Any:
        previous = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            return fn(*args)
        finally:
            torch.set_autocast_cache_enabled(previous)

    return run


def check_recompute(mode: str | None) -> None:
    """Raise ValueError for a mode not in `RECOMPUTE_MODES`."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")


def check_full_layers(full_layers: int, mode: str | None) -> None:
    """Raise ValueError for a `full_layers` that is not an int >= 0, or given with mode "full"
    (every layer recomputes fully already)."""
    if isinstance(full_layers, bool) or not isinstance(full_layers, int) or full_layers < 0:
        raise ValueError(f"recompute_full_layers must be an int >= 0, got {full_layers!r}")
    if full_layers and mode == "full":
        raise ValueError(
            f"recompute_full_layers={full_layers} picks the layers that recompute fully "
            "among others; with recompute='full' every layer does already: choose another "
            "recompute mode for the rest, or drop recompute_full_layers"
        )


def rebuilt_norm_then(norm: Callable[..., Any], h: torch.Tensor, then: Callable[..., Any], *args):
    """`then(norm(h), *args)` with the norm recomputed ("light" mode): the norm keeps only its
    input h, and wherever `then` saves the norm's output (or a cast of it made through
    `cast_in_region`) backward makes it again from h (`nanotrain.parallel.saved_rebuild`)."""
    with RebuiltSaves() as saves:
        x = saves.track(recomputed(norm, h), norm, h)
        return then(x, *args)
