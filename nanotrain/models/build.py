"""`build_model` (meta-device construction, then materialize) and deterministic `init_weights`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanotrain.models.config import DeepSeekConfig, DenseConfig
from nanotrain.models.deepseek import DeepSeekV3
from nanotrain.models.layers import RMSNorm
from nanotrain.models.moe import DeepSeekMoE, GroupedExperts
from nanotrain.models.transformer import CausalLM, DenseTransformer
from nanotrain.parallel.tensor import VocabParallelEmbedding, _TensorParallelModule


def build_model(
    config: DenseConfig | DeepSeekConfig,
    mesh: Any = None,
    device: torch.device | str | None = None,
    *,
    generator: torch.Generator | None = None,
    sequence_parallel: bool = False,
) -> CausalLM:
    """Build the model for `config`: `DeepSeekV3` or `DenseTransformer`.

    The model is always constructed on the meta device (instant, whatever its size). With
    device="meta" it is returned as is; otherwise it is materialized on `device` (default CPU)
    and initialized by `init_weights(model, generator)`, so the same RNG state (or generator
    seed) gives the same model.

    Args:
        config: DenseConfig or DeepSeekConfig.
        mesh: a ParallelMesh or None (one process); its `tp_group` splits heads and widths,
            its `ep_group` the routed experts of every MoE layer (MTP blocks included), and
            its `ep_node_groups` (when set) make their dropless dispatch node-limited, and
            its `cp_group` (when cp > 1) splits each sequence (context parallelism).
        device: "meta", "cpu", "cuda", ... (None = "cpu").
        generator: optional torch.Generator on `device` for the initialization.
        sequence_parallel: shard activations outside the tensor-parallel matmuls along the
            sequence over the mesh's tp group (Megatron sequence parallelism; see
            docs/parallelism.md). No effect without a tp group of 2 or more ranks.
    Raises:
        TypeError: for any other config type.
    """
    tp_group = getattr(mesh, "tp_group", None) if mesh is not None else None
    ep_group = getattr(mesh, "ep_group", None) if mesh is not None else None
    cp_group = getattr(mesh, "cp_group", None) if mesh is not None else None
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
        model = cls(
            config,
            tp_group=tp_group,
            device="meta",
            sequence_parallel=sequence_parallel,
            ep_group=ep_group,
            cp_group=cp_group,
        )
    node_groups = getattr(mesh, "ep_node_groups", None) if mesh is not None else None
    if node_groups is not None:
        for sub in model.modules():
            if isinstance(sub, DeepSeekMoE):
                sub.node_groups = node_groups
    device = torch.device("cpu" if device is None else device)
    if device.type != "meta":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty makes a new tensor per module, breaking the tie
        init_weights(model, generator)
    return model


def replicated_expert_compute(
    config: DenseConfig | DeepSeekConfig, tp_size: int, sequence_parallel: bool
) -> str | None:
    """Why this layout makes every tensor-parallel rank run the same routed experts on the
    same tokens, or None when it does not.

    Routed experts are not split over tp (ep splits them). Each tp rank therefore runs them on
    the tokens it holds: all of its replica's tokens without sequence parallelism, or with a
    `capacity_factor` (capacity is counted per whole sequence, so the MoE layer gathers the
    sequence first); only sequence parallelism with dropless routing gives each tp rank its
    own T / tp tokens. Megatron-LM requires sequence parallelism for MoE with tp for this
    reason.

    Args: config: the model config; tp_size: tensor-parallel ranks; sequence_parallel: the
        strategy's flag.
    Returns: a message that names the cost and the fix, or None.
    """
    if not isinstance(config, DeepSeekConfig) or tp_size < 2:
        return None
    if config.first_k_dense_replace >= config.num_layers:
        return None  # every layer dense (MTP blocks then are too)
    if sequence_parallel and config.capacity_factor is None:
        return None
    if not sequence_parallel:
        cause = "without sequence parallelism"
        fix = "pass sequence_parallel=True to MegatronStrategy"
    else:
        cause = f"with capacity_factor={config.capacity_factor} (a capacity per whole sequence)"
        fix = "train dropless (capacity_factor=None) under sequence parallelism"
    return (
        f"the routed experts are replicated over the {tp_size} tensor-parallel ranks and, "
        f"{cause}, every tp rank runs them on the same tokens: {tp_size}x the routed-expert "
        f"FLOPs for no gain. To split that work, {fix}, or move the expert capacity to expert "
        "parallelism (ep) instead of tp."
    )


@torch.no_grad()
def init_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """Initialize every parameter and buffer in module-definition order.

    Matrices and expert stacks (ndim >= 2, embedding included): normal(0, config.init_std);
    RMSNorm weights: ones; other vectors (biases, none in the presets): zeros; buffers
    (router bias, load counters): zeros. Tied weights are initialized once. A tensor-parallel
    layer draws its *full* unsharded weight and keeps its own shard, and an expert-parallel
    `GroupedExperts` draws all E experts and keeps its own, so every tp and ep size gets the
    same weights from the same generator state (this costs one full-size temporary per
    layer).

    Parameters still on the meta device (the parts of the model another pipeline stage
    builds) are skipped but their draws are made and dropped, so a stage that materializes
    only its own modules gets the same values as the whole model.

    Args:
        model: a built model with a `config` attribute.
        generator: optional torch.Generator (must live on the parameters' device);
            None uses the global RNG.
    """
    std = model.config.init_std
    seen: set[int] = set()
    for module in model.modules():
        fresh = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in fresh)
        if not fresh:
            continue
        if all(p.is_meta for _, p in fresh):
            # Not built on this rank (another pipeline stage owns it): draw and drop what the
            # whole model would draw here, so later weights get the same values.
            _skip_draws(module, fresh, model, std, generator)
            continue
        is_head = module is getattr(model, "lm_head", None)
        full = {}
        for name, param in fresh:
            shape = _full_shape(module, name, param)
            if is_head and name == "weight":
                # The head is padded to a multiple of tp: draw only the real vocabulary rows,
                # so the generator state after it (every later weight) is the same for any tp.
                full[name] = _pad_rows(
                    _draw(param, (model.config.vocab_size, *shape[1:]), std, False, generator),
                    shape[0],
                )
            else:
                full[name] = _draw(param, shape, std, isinstance(module, RMSNorm), generator)
        if isinstance(module, _TensorParallelModule) and module.tp_size > 1:
            full = module.shard_full_state_dict(full)
        if isinstance(module, GroupedExperts) and module.ep_size > 1:
            full = module.shard_full_state_dict(full)
        for name, param in fresh:
            param.copy_(full[name])
    for buf in model.buffers():
        buf.zero_()


def _skip_draws(
    module: nn.Module,
    fresh: list[tuple[str, nn.Parameter]],
    model: nn.Module,
    std: float,
    generator: torch.Generator | None,
) -> None:
    """Advance the RNG exactly as initializing `module`'s meta parameters would (one
    full-size scratch tensor at a time, freed at once)."""
    # the device whose RNG the real draws use: the generator's, or that of the built params
    real = (p.device for p in model.parameters() if not p.is_meta)
    device = generator.device if generator is not None else next(real, torch.device("cpu"))
    for name, param in fresh:
        shape = _full_shape(module, name, param)
        if module is getattr(model, "lm_head", None) and name == "weight":
            shape = (model.config.vocab_size, *shape[1:])
        if len(shape) >= 2:
            torch.empty(shape, device=device, dtype=param.dtype).normal_(
                0.0, std, generator=generator
            )


def _full_shape(module: nn.Module, name: str, param: torch.Tensor) -> tuple[int, ...]:
    """Unsharded shape of `module.<name>` (its own shape outside tensor/expert parallelism)."""
    if isinstance(module, GroupedExperts):
        return module.full_shape(name)
    if not isinstance(module, _TensorParallelModule) or module.tp_size == 1:
        return tuple(param.shape)
    if isinstance(module, VocabParallelEmbedding):
        return (module.num_embeddings, module.embedding_dim)  # unpadded; sharding pads
    dim = module.tp_partition_dims[name]
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= module.tp_size
    return tuple(shape)


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` with zero rows appended up to `rows`."""
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def _draw(
    like: torch.Tensor,
    shape: tuple[int, ...],
    std: float,
    is_norm: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """normal(0, std) for matrices, ones for norm weights, zeros for other vectors."""
    out = torch.empty(shape, device=like.device, dtype=like.dtype)
    if len(shape) >= 2:
        return out.normal_(0.0, std, generator=generator)
    return out.fill_(1.0 if is_norm else 0.0)
