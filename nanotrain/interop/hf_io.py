"""Hugging Face checkpoint files: write (`export_hf`) and read (`read_hf_checkpoint`,
`import_hf`) a transformers folder of config.json + safetensors.

The key and config mapping lives in `nanotrain.interop.hf`; this module only moves tensors
between that mapping and files. Pickled `.bin` weights are never read.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nanotrain.interop.hf import (
    ModelConfig,
    config_from_hf,
    config_to_hf,
    state_dict_from_hf,
    state_dict_to_hf,
)
from nanotrain.interop.safetensors_writer import save_file_streaming
from nanotrain.models.build import build_model
from nanotrain.models.config import DeepSeekConfig
from nanotrain.models.lazy import LazyTensor, materialize_all, open_safetensors
from nanotrain.models.transformer import CausalLM


def _dtype_name(tensors: dict[str, Tensor | LazyTensor]) -> str:
    """The weights' dtype name for config.json ("float32", "bfloat16", ...)."""
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) > 1:  # the router bias stays fp32 in a bf16 model; report the weights'
        dtypes.discard(torch.float32)
    return str(next(iter(dtypes), torch.float32)).removeprefix("torch.")


def export_hf(
    model_or_state_dict: nn.Module | dict[str, Tensor | LazyTensor],
    config: ModelConfig,
    out_dir: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write `config.json` + safetensors that `transformers.AutoModelForCausalLM` loads.

    Args:
        model_or_state_dict: our single-process model, or its full (gathered) state_dict;
            values may be `LazyTensor`s (e.g. `merge.open_model_shards`), read one at a time
            while the files are written (`save_file_streaming`), so only one tensor is in
            memory at once (one expert's slice for routed experts).
        config: the model's config. out_dir: created if needed; existing files are overwritten.
        max_shard_bytes: None writes one `model.safetensors`; otherwise shards of at most
            about this size plus `model.safetensors.index.json`, as `save_pretrained` does.
    Returns: the output folder.
    Raises: ValueError/TypeError from `config_to_hf` and `state_dict_to_hf`.
    """
    state = model_or_state_dict
    if isinstance(state, nn.Module):
        state = state.state_dict()
    hf_config = config_to_hf(config)
    # written one at a time (views sharing storage, e.g. unbound expert slices, are fine)
    tensors = {
        k: v if isinstance(v, LazyTensor) else v.detach()
        for k, v in state_dict_to_hf(config, state).items()
    }
    hf_config["torch_dtype"] = hf_config["dtype"] = _dtype_name(tensors)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    shards = _split_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file_streaming(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return out
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file_streaming(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _split_shards(tensors: dict[str, Any], max_bytes: int | None) -> list[dict[str, Any]]:
    if max_bytes is None:
        return [tensors]
    if max_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0 (or None for one file), got {max_bytes}")
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    return shards


def read_hf_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Read a transformers checkpoint folder: (config.json dict, all tensors on CPU).

    Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`, or
    else every `*.safetensors` file in the folder. Never unpickles (.bin files are refused).

    Raises:
        FileNotFoundError: without config.json or any safetensors file.
    """
    hf_config, lazy = open_hf_checkpoint(path)
    return hf_config, {key: t.read() for key, t in lazy.items()}


def open_hf_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, LazyTensor]]:
    """`read_hf_checkpoint` without reading any tensor: (config.json dict, name ->
    `LazyTensor`), from the files' headers only.

    Raises:
        FileNotFoundError: without config.json or any safetensors file.
        ValueError: a corrupt safetensors file (named).
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder / 'config.json'} not found; pass a transformers checkpoint folder"
        )
    hf_config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(
            {folder / name for name in json.loads(index.read_text())["weight_map"].values()}
        )
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no safetensors weights in {folder}; convert .bin checkpoints with transformers' "
            "save_pretrained(safe_serialization=True) first (pickles are never loaded)"
        )
    tensors: dict[str, LazyTensor] = {}
    for file in files:
        tensors.update(open_safetensors(file))
    return hf_config, tensors


def _mtp_layers_present(config: DeepSeekConfig, hf_tensors: dict[str, Any]) -> int:
    k = 0
    while f"model.layers.{config.num_layers + k}.eh_proj.weight" in hf_tensors:
        k += 1
    return k


def load_hf_weights(
    path: str | Path, stacklevel: int = 2, *, lazy: bool = False
) -> tuple[ModelConfig, dict[str, Any]]:
    """(our config, full state dict with our names) of a transformers checkpoint folder: the
    one reading path behind `import_hf`, `nanotrain import` and
    `LanguageModelModule(model=<folder>)`.

    With `lazy=True` the values are `LazyTensor`s and nothing but the files' headers is read:
    the conversion (stacking per-expert tensors, splitting a fused `gate_up_proj`) is lazy
    too, so whoever reads a slice later reads only that slice from the files. Otherwise every
    tensor is read (tied names keep sharing one tensor).

    When config.json announces more MTP layers than the weights hold (transformers'
    `save_pretrained` writes `num_nextn_predict_layers=1` without any MTP weights), the
    config's `mtp_depth` is lowered to what is present, with a warning.

    Raises: FileNotFoundError / ValueError from `read_hf_checkpoint`, `config_from_hf` and
    `state_dict_from_hf`.
    """
    hf_config, hf_tensors = open_hf_checkpoint(path)
    config = config_from_hf(hf_config)
    if isinstance(config, DeepSeekConfig):
        present = _mtp_layers_present(config, hf_tensors)
        if present < config.mtp_depth:
            warnings.warn(
                f"config.json announces {config.mtp_depth} MTP layer(s) but the weights hold "
                f"{present}; importing with mtp_depth={present}",
                stacklevel=stacklevel,
            )
            config = replace(config, mtp_depth=present)
    state = state_dict_from_hf(config, hf_tensors)
    return config, state if lazy else materialize_all(state)


def import_hf(
    path: str | Path, device: torch.device | str | None = None
) -> tuple[ModelConfig, CausalLM]:
    """Load a transformers checkpoint folder as our config and single-process model (fp32)
    (what `load_hf_weights` reads, in a model).

    Raises: FileNotFoundError / ValueError from `load_hf_weights`.
    """
    config, state = load_hf_weights(path, stacklevel=3)
    model = build_model(config, device="meta")
    model.to_empty(device=torch.device("cpu" if device is None else device))
    if config.tie_word_embeddings:  # to_empty may give the tied pair separate storage
        model.lm_head.weight = model.embed_tokens.weight
    for buf in model.buffers():  # non-persistent counters are not in the checkpoint
        buf.zero_()
    model.load_state_dict(state, strict=True)
    return config, model
