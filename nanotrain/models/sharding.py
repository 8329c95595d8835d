"""Load a whole model's state dict (one-process names and shapes) into one rank's share of it.

A pretrained folder holds the *full* tensors: `embed_tokens.weight` [V, H], every routed
expert stacked [E, ...], and so on. Under `MegatronStrategy` a rank holds only slices of some
of them, under the same names:

* tensor-parallel layers (`nanotrain.parallel.tensor`) keep their rows or columns; the
  vocabulary-parallel embedding and the LM head first pad the vocabulary with zero rows to a
  multiple of tp, exactly as `init_weights` does;
* an expert-parallel `GroupedExperts` keeps its contiguous range of experts;
* a pipeline stage (`PipelineStage`) holds only its layers (plus, on the last stage, a copy
  of the embedding when MTP or tied weights need it, named `embed_tokens.weight` like the
  first stage's);
* everything else (norms, replicated projections, the router and its bias buffer) is copied.

`load_full_state_dict` checks the whole dict first (keys, then shapes) and copies only when
everything fits, so a failed load leaves the model as it was.

The full tensors may be `LazyTensor`s (`nanotrain.models.lazy`, e.g. from
`model_io.open_pretrained`): then a rank reads from the files only the slices it keeps (its
rows or columns, its experts) and never touches the tensors of other pipeline stages, one
tensor at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor, nn

from nanotrain.models.build import _full_shape, _pad_rows
from nanotrain.models.lazy import LazyTensor
from nanotrain.models.moe import GroupedExperts
from nanotrain.models.stages import PipelineStage
from nanotrain.parallel.tensor import VocabParallelEmbedding, _TensorParallelModule, shard_tensor

__all__ = ["LoadResult", "load_full_state_dict", "shard_full_entry"]

# a wrapper prefix left on the keys (LanguageModelModule's state_dict carries it)
_WRAPPER_PREFIX = "model."


class LoadResult(NamedTuple):
    """What `load_full_state_dict(strict=False)` could not match.

    Attributes:
        missing_keys: parameters this rank holds that the state dict lacks (left as they were).
        unexpected_keys: state-dict keys that name nothing in the whole model (ignored).
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


class _Entry(NamedTuple):
    """One tensor this rank holds: where it lives and the full value that feeds it."""

    key: str  # the name the value was found under
    target: Tensor  # this rank's parameter or buffer (tied names share one)
    owner: nn.Module  # the module registering it (the first name's, for tied weights)
    local: str  # its name inside `owner`
    value: Tensor | LazyTensor  # the full, unsharded tensor (maybe not read yet)


def load_full_state_dict(
    model: nn.Module, full: Mapping[str, Tensor | LazyTensor], *, strict: bool = True
) -> LoadResult:
    """Copy this rank's slice of every tensor it holds from an unsharded state dict.

    Works for a whole model (`build_model`, any tp / ep / sequence-parallel layout) and for a
    `PipelineStage`: under pipeline parallelism only the parameters this stage holds are
    required, and keys of other stages' parameters are expected, not unexpected. Tied weights
    (`lm_head.weight` and `embed_tokens.weight`, one tensor) are loaded once from whichever of
    their names is present. Persistent buffers (the router's `e_score_correction_bias`) are
    loaded when present and keep their values when absent. Values are cast to each
    parameter's dtype and device.

    Args:
        model: this rank's model (its parameters are named like the one-process model's).
        full: name -> full tensor, e.g. `model_io.load_pretrained(folder)[1]` or the
            `state_dict()` of the one-process model: embedding and head with `vocab_size`
            rows (unpadded), routed experts stacked over all experts. Values may be
            `LazyTensor`s (`model_io.open_pretrained(folder)[1]`): only this rank's slices of
            the tensors it holds are then read, one tensor at a time.
        strict: raise when a parameter this rank holds is missing or a key names nothing in
            the whole model; with False, report them in the result and load the rest.

    Returns:
        `LoadResult` (both lists empty after a strict load).

    Raises:
        TypeError: `full` is not a mapping of tensors.
        ValueError: missing or unexpected keys (strict), or a tensor whose shape does not
            match the model's (always); nothing is copied then.
    """
    if not isinstance(full, Mapping):
        raise TypeError(
            "load_full_state_dict needs a mapping of parameter names to tensors (a state_dict), "
            f"got {type(full).__name__}"
        )
    not_tensors = [k for k, v in full.items() if not isinstance(v, Tensor | LazyTensor)]
    if not_tensors:
        raise TypeError(
            f"load_full_state_dict needs a mapping of parameter names to tensors, but "
            f"{not_tensors[:5]} hold other values; convert them with torch.as_tensor"
        )
    whole = model.full if isinstance(model, PipelineStage) else model
    unexpected = sorted(set(full) - set(whole.state_dict(keep_vars=True)))
    entries, missing = _match(model, full)
    if strict and (missing or unexpected):
        raise ValueError(_key_message(missing, unexpected))
    bad_shapes = [_shape_problem(model, e) for e in entries]
    bad_shapes = [p for p in bad_shapes if p is not None]
    if bad_shapes:
        raise ValueError(
            f"{len(bad_shapes)} tensor(s) do not fit the model: "
            + "; ".join(bad_shapes[:5])
            + ". The weights were saved for another config: build the model from the folder's "
            "own config and leave out model_overrides that change shapes"
        )
    with torch.no_grad():
        for e in entries:
            e.target.copy_(shard_full_entry(model, e.owner, e.local, e.value))
    return LoadResult(missing, unexpected)


def shard_full_entry(
    model: nn.Module, owner: nn.Module, local: str, value: Tensor | LazyTensor
) -> Tensor:
    """This rank's slice of `value`, the full tensor of `owner.<local>` (a part of `model`).

    Tensor-parallel layers slice along their partition dim (the embedding and LM head after
    padding the vocabulary to a multiple of tp with zero rows), expert-parallel
    `GroupedExperts` keep their experts; anything else is returned as it is. A `LazyTensor`
    is read only as far as the slice goes (`_read_rank_slice`).

    Raises:
        ValueError: a tensor-parallel dim that does not split evenly over tp.
    """
    if isinstance(value, LazyTensor):
        return _read_rank_slice(model, owner, local, value)
    if isinstance(owner, VocabParallelEmbedding):
        return owner.shard_full_weight(value)  # pads to a multiple of tp itself
    if isinstance(owner, _TensorParallelModule):
        if owner is getattr(model, "lm_head", None) and local == "weight":
            # the head is padded like the embedding (zero rows), as init_weights pads it
            value = _pad_rows(value, owner.out_features)
        return shard_tensor(value, owner.tp_partition_dims.get(local), owner.tp_rank, owner.tp_size)
    if isinstance(owner, GroupedExperts) and local in owner.ep_partition_dims:
        return owner.shard_full_state_dict({local: value})[local]
    return value


def _read_rank_slice(model: nn.Module, owner: nn.Module, local: str, value: LazyTensor) -> Tensor:
    """`shard_full_entry` of a lazy tensor: reads only this rank's slice from its files.

    The values equal the eager path's: the same rows or columns of the same (zero-padded)
    full tensor, without reading the others.
    """
    if isinstance(owner, GroupedExperts) and local in owner.ep_partition_dims:
        dim = owner.ep_partition_dims[local]
        return value.narrow(dim, owner.expert_offset, owner.num_local_experts).read()
    if not isinstance(owner, _TensorParallelModule):
        return value.read()
    dim, padded = owner.tp_partition_dims.get(local), None
    if isinstance(owner, VocabParallelEmbedding):
        if value.shape[0] != owner.num_embeddings:
            raise ValueError(
                f"full embedding has {value.shape[0]} rows; expected num_embeddings="
                f"{owner.num_embeddings} (unpadded)"
            )
        padded = owner.padded_num_embeddings
    elif owner is getattr(model, "lm_head", None) and local == "weight":
        padded = max(owner.out_features, value.shape[0])  # zero rows, as init_weights pads
    if dim is None or (owner.tp_size == 1 and padded is None):
        return value.read()
    shape = list(value.shape)
    if padded is not None:
        shape[dim] = padded
    if shape[dim] % owner.tp_size != 0:
        raise ValueError(
            f"cannot shard dim {dim} of shape {tuple(shape)} into {owner.tp_size} parts; "
            f"{shape[dim]} is not divisible by {owner.tp_size}"
        )
    per_rank = shape[dim] // owner.tp_size
    start = owner.tp_rank * per_rank
    stored = max(min(start + per_rank, value.shape[dim]) - start, 0)  # the rest is padding
    piece = value.narrow(dim, min(start, value.shape[dim]), stored).read()
    if stored < per_rank:
        pad = list(piece.shape)
        pad[dim] = per_rank - stored
        piece = torch.cat([piece, piece.new_zeros(pad)], dim=dim)
    return piece


def _match(
    model: nn.Module, full: Mapping[str, Tensor | LazyTensor]
) -> tuple[list[_Entry], list[str]]:
    """Pair each tensor this rank holds with its full value; list the missing parameters."""
    names: dict[int, list[str]] = {}  # tensor id -> every name it goes by (tied weights)
    tensors: dict[int, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    entries, missing = [], []
    for tid, aliases in names.items():
        tensor = tensors[tid]
        key = next((n for n in aliases if n in full), None)
        if key is None:
            if isinstance(tensor, nn.Parameter):  # buffers (router bias) may be absent
                missing.append(aliases[0])
            continue
        prefix, _, local = aliases[0].rpartition(".")
        owner = model.get_submodule(prefix)
        entries.append(_Entry(key, tensor, owner, local, full[key]))
    return entries, missing


def _shape_problem(model: nn.Module, e: _Entry) -> str | None:
    """Why `e.value` cannot feed `e.target` (None when it fits)."""
    expected = tuple(_full_shape(e.owner, e.local, e.target))
    if e.owner is getattr(model, "lm_head", None) and e.local == "weight":
        expected = (model.config.vocab_size, *expected[1:])  # saved without tp padding
    got = tuple(e.value.shape)
    if got != expected:
        return f"{e.key!r} has shape {got}, the model's is {expected}"
    return None


def _key_message(missing: list[str], unexpected: list[str]) -> str:
    """A strict-load error naming the keys (a few of each) and the likely fix."""
    parts = []
    if missing:
        parts.append(
            f"missing {len(missing)} parameter(s) this rank holds: {missing[:5]}"
            + (" ..." if len(missing) > 5 else "")
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} unexpected key(s) that name nothing in the model: "
            f"{unexpected[:5]}" + (" ..." if len(unexpected) > 5 else "")
        )
    if unexpected and all(k.startswith(_WRAPPER_PREFIX) for k in unexpected):
        fix = f"strip the {_WRAPPER_PREFIX!r} prefix a module wrapper left on the keys"
    else:
        fix = (
            "the weights were saved for another config (compare num_layers, mtp_depth, "
            "tie_word_embeddings with the folder's config), or pass strict=False to load "
            "what matches"
        )
    return "the state dict does not fit the model: " + "; ".join(parts) + f". Fix: {fix}"
