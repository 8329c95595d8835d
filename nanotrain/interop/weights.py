"""Model weights in and out of nanotrain: `nanotrain export` / `nanotrain import` and the
pretrained folders `LanguageModelModule(model=<folder>)` starts from.

A *weights folder* holds `model_config.json` ({"family": "DeepSeekConfig" | "DenseConfig",
"config": {...fields}}) and `model.safetensors` (our parameter names, e.g.
`layers.0.self_attn.o_proj.weight`). A transformers folder (config.json + safetensors) is
accepted wherever a weights folder is.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from torch import Tensor

from nanotrain.checkpoint.merge import MODULE_PREFIX, checkpoint_config
from nanotrain.interop.safetensors_writer import save_file_streaming
from nanotrain.models.config import DeepSeekConfig, DenseConfig, config_from_dict, config_to_dict
from nanotrain.models.lazy import LazyTensor, materialize_all, open_safetensors

CONFIG_FILE = "model_config.json"
WEIGHTS_FILE = "model.safetensors"


def save_weights(
    config: DeepSeekConfig | DenseConfig, state: dict[str, Tensor | LazyTensor], out: str | Path
) -> Path:
    """Write a weights folder: `model_config.json` + `model.safetensors` (CPU copies).

    The tensors are written one at a time (`save_file_streaming`): `LazyTensor` values are
    read only when their turn comes, so a lazy state dict is never whole in memory.
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v if isinstance(v, LazyTensor) else v.detach() for k, v in state.items()}
    save_file_streaming(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
    return folder


def is_pretrained_folder(path: str | Path) -> bool:
    """True for a weights folder or a transformers folder (a directory with a config file)."""
    folder = Path(path)
    return folder.is_dir() and (
        (folder / CONFIG_FILE).is_file() or (folder / "config.json").is_file()
    )


def read_model_config(path: str | Path) -> DeepSeekConfig | DenseConfig:
    """The model config alone, no weights needed: from a weights folder (`model_config.json`),
    a transformers folder (`config.json`), or either file given directly (a transformers
    config.json is told apart by its "model_type" or "architectures").

    Raises:
        FileNotFoundError: nothing at `path`, or a folder with neither config file.
        ValueError: a config that is not valid JSON or not a supported model.
    """
    target = Path(path)
    if target.is_dir():
        found = [target / name for name in (CONFIG_FILE, "config.json")]
        files = [f for f in found if f.is_file()]
        if not files:
            raise FileNotFoundError(
                f"{target} holds no model config: expected {CONFIG_FILE} (from `nanotrain "
                "import`) or a transformers config.json"
            )
        target = files[0]
    elif not target.is_file():
        raise FileNotFoundError(
            f"{target} not found: give a preset name, a model folder or a config file"
        )
    try:
        data = json.loads(target.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{target} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{target} does not hold a JSON object")
    if "model_type" in data or "architectures" in data:
        from nanotrain.interop.hf import config_from_hf

        return config_from_hf(data)
    return config_from_dict(data)


def load_pretrained(path: str | Path) -> tuple[DeepSeekConfig | DenseConfig, dict[str, Tensor]]:
    """(config, state dict with our names) from a weights folder or a transformers folder.

    Raises:
        FileNotFoundError: the folder has neither `model_config.json` nor `config.json`.
        ValueError: the config or the tensors do not match a supported model.
    """
    config, lazy = open_pretrained(path, stacklevel=3)
    return config, materialize_all(lazy)


def open_pretrained(
    path: str | Path, stacklevel: int = 2
) -> tuple[DeepSeekConfig | DenseConfig, dict[str, LazyTensor]]:
    """`load_pretrained` without reading the weights: (config, name -> `LazyTensor`).

    Only the config and the safetensors headers are read. `LanguageModelModule(model=folder)`
    uses it so that each rank of a sharded layout reads only its own slices
    (`nanotrain.models.sharding.load_full_state_dict`).

    Raises:
        FileNotFoundError: the folder has neither `model_config.json` nor `config.json`, or
            lacks its weights file.
        ValueError: the config or the tensors do not match a supported model, or a corrupt
            weights file.
    """
    folder = Path(path)
    if (folder / CONFIG_FILE).is_file():
        config = read_model_config(folder / CONFIG_FILE)
        if not (folder / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{folder / WEIGHTS_FILE} not found next to {CONFIG_FILE}")
        return config, open_safetensors(folder / WEIGHTS_FILE)
    if (folder / "config.json").is_file():
        from nanotrain.interop.hf_io import load_hf_weights

        # the same reading as import_hf (e.g. MTP layers announced but absent are dropped)
        return load_hf_weights(folder, stacklevel=stacklevel + 1, lazy=True)
    raise FileNotFoundError(
        f"{folder} is not a model folder: expected {CONFIG_FILE} (from `nanotrain import`) or "
        "a transformers config.json"
    )


def checkpoint_model(ckpt: str | Path) -> tuple[DeepSeekConfig | DenseConfig, dict[str, Tensor]]:
    """(config, whole-model state dict with our names) of a LanguageModelModule checkpoint.

    Works for every strategy's checkpoints: one saved under a sharded `MegatronStrategy`
    layout (tp / pp / ep, ZeRO) is merged from its per-rank shards in this process
    (`nanotrain.checkpoint.merge.merge_model_shards`), giving the same tensors a one-process
    model with those weights holds.

    Raises:
        FileNotFoundError / ValueError: a missing or corrupt checkpoint (or shard), one not
            written by a LanguageModelModule (no model config inside), or shards that do not
            fit the recorded layout and config.
    """
    with contextlib.ExitStack() as stack:
        config, weights = open_checkpoint_model(ckpt, stack)
        return config, materialize_all(weights)


def open_checkpoint_model(
    ckpt: str | Path, stack: contextlib.ExitStack | None = None
) -> tuple[DeepSeekConfig | DenseConfig, dict[str, Tensor | LazyTensor]]:
    """`checkpoint_model` that reads a sharded checkpoint's tensors only when asked: its
    values are `LazyTensor`s merging the shards of one tensor when read
    (`nanotrain.checkpoint.merge.open_model_shards`; `stack` closes the shard files). An
    unsharded checkpoint holds one process's whole model and is read as it is.

    Raises:
        as `checkpoint_model`.
    """
    from nanotrain.checkpoint import files, load_model_weights
    from nanotrain.checkpoint.merge import open_model_shards
    from nanotrain.checkpoint.resume import resolve_path

    # a checkpoint directory, or a run's checkpoints folder or its `last` file (the newest
    # complete checkpoint), as `ckpt_path` takes them
    folder = resolve_path(Path(ckpt))
    config = checkpoint_config(folder)
    if files.read_meta(folder).get("layout") is None:
        state: dict[str, Any] = load_model_weights(folder)
    else:
        state = open_model_shards(folder, stack=stack)
    weights = {k[len(MODULE_PREFIX) :]: v for k, v in state.items() if k.startswith(MODULE_PREFIX)}
    return config, weights


EXPORT_FORMATS = ("hf", "nanotrain")


def export_checkpoint(ckpt: str | Path, out: str | Path, to: str = "hf") -> Path:
    """`nanotrain export`: a training checkpoint (any strategy, sharded ones included) as a
    model folder.

    Args:
        ckpt: a checkpoint directory of a LanguageModelModule, or a run's checkpoints folder
            or its `last` file (then its newest complete checkpoint).
        out: the folder to write (created if needed).
        to: "hf" for a transformers folder (config.json + safetensors), "nanotrain" for a
            weights folder (model_config.json + model.safetensors); both are accepted by
            `LanguageModelModule(model=<folder>)` under any strategy and layout.

    Returns:
        `out` as a Path.

    Raises:
        ValueError: an unknown `to`, or as `checkpoint_model`.
    """
    if to not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format to={to!r}; choose one of {EXPORT_FORMATS}")
    from nanotrain.interop.hf_io import export_hf

    # lazily: each tensor is merged from its shards when the writer reaches it, then dropped
    with contextlib.ExitStack() as stack:
        config, weights = open_checkpoint_model(ckpt, stack)
        if to == "nanotrain":
            return save_weights(config, weights, out)
        return Path(export_hf(weights, config, out))


def import_checkpoint(hf_folder: str | Path, out: str | Path) -> Path:
    """`nanotrain import`: a transformers folder → a nanotrain weights folder."""
    config, weights = load_pretrained(hf_folder)
    return save_weights(config, weights, out)
