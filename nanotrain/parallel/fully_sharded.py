"""ZeRO-3 on torch's FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and
optimizer state sharded over the data-parallel group.

Wrapping rule (what `shard_fully` calls ``fully_shard`` on, innermost first):

1. every routed-expert stack (`GroupedExperts`, the modules whose parameters are tagged by
   `nanotrain.parallel.expert.mark_expert_params`): over the **expert-data-parallel** group,
   gradient divide factor ``dp`` (an expert's local gradient already sums the tokens of its
   whole expert-parallel group; see `nanotrain.parallel.data_parallel`);
2. every decoder layer (each entry of a ``layers`` `nn.ModuleList` / `nn.ModuleDict`, which a
   pipeline stage holds too): over the **data-parallel** group; the experts inside are
   already wrapped and stay out of it;
3. the root: a `StepRunner` around the whole `NanoModule`: embedding, final norm, head, MTP
   blocks (whose parts the model calls outside the block's own forward) and any parameter
   left, over the data-parallel group, never resharded after forward (its parameters are
   the next thing backward needs).

Each wrapped unit's parameters become `DTensor`s ``Shard(0)`` over its group's 1-D
`DeviceMesh` (dim 0 of the rank-local tensor, i.e. of a tensor-parallel slice: FSDP2 pads
it to a multiple of the group size). Forward all-gathers a unit just before it runs and,
with ``reshard_after_forward=True``, frees the gathered copy after it; backward gathers it
again and reduce-scatters its gradient (divided by ``dp``) into the rank's shard. The
optimizer therefore steps only the shards: per-rank parameter + gradient + optimizer bytes
are ``(P_dense / dp + P_expert_local / expert_dp) * (4 + 4 + optimizer bytes per element)``
plus FSDP2's padding of dim 0 (under one row per tensor per rank).

Why a `StepRunner`: FSDP2 gathers the root's parameters in the root's forward pre-hook and
queues the end-of-backward work from hooks on its outputs; a `NanoModule` is driven through
``training_step``, not ``forward``, so the runner's ``forward(fn, *args)`` calls the step
function inside the root's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from nanotrain.parallel.expert import is_expert_param

__all__ = [
    "StepRunner",
    "local_tensor",
    "shard_fully",
    "reduce_after_schedule",
    "wrapped_units",
]


class StepRunner(nn.Module):
    """Root of the FSDP2 wrapping: holds the `NanoModule` as ``module`` and runs a step
    function inside FSDP2's root forward hooks.

    ``runner(fn, *args)`` returns ``fn(*args)`` (e.g. ``module.training_step``), whose tensors
    FSDP2 hooks for backward.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` (inside the root's forward hooks)."""
        return fn(*args)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a `DTensor`; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_expert_stack(module: nn.Module) -> bool:
    own = list(module.parameters(recurse=False))
    return bool(own) and all(is_expert_param(p) for p in own)


def wrapped_units(module: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules the wrapping rule shards on their own (module docstring): (expert stacks,
    decoder layers), each in model order."""
    experts = [m for m in module.modules() if _is_expert_stack(m)]
    blocks: list[nn.Module] = []
    for name, sub in module.named_modules():
        if name.rpartition(".")[2] != "layers":
            continue
        if isinstance(sub, nn.ModuleDict):
            blocks.extend(sub.values())
        elif isinstance(sub, nn.ModuleList):
            blocks.extend(sub)
    seen: set[int] = set()
    unique = []
    for block in blocks:  # a pipeline stage also reaches its layers through the whole model
        if id(block) not in seen:
            seen.add(id(block))
            unique.append(block)
    return experts, unique


def device_mesh_of(group: ProcessGroup, device: torch.device) -> DeviceMesh:
    """A 1-D `DeviceMesh` over the ranks of an existing process group."""
    return DeviceMesh.from_group(group, device.type)


def shard_fully(
    module: nn.Module,
    *,
    dp_group: ProcessGroup,
    expert_dp_group: ProcessGroup,
    dp_size: int,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> StepRunner:
    """Apply the wrapping rule (module docstring) to ``module`` and return the root runner.

    Args:
        module: the built model (a `NanoModule`), on ``device`` (its parameters are replaced
            in place by `DTensor` shards; names do not change).
        dp_group, expert_dp_group: the data-parallel and expert-data-parallel groups.
        dp_size: the full data-parallel size (every gradient is divided by it).
        device: the compute device (parameters are gathered there).
        mp_policy: FSDP2's mixed precision (parameter dtype in compute, reduce dtype); None:
            parameters compute in their own dtype.
        reshard_after_forward: free each decoder layer's gathered parameters after its
            forward (all-gather again in backward); False keeps them until backward (no
            second all-gather, more memory). The root never reshards after forward.
        cpu_offload: keep the shards, their gradients and the optimizer state on the host
            (FSDP2's `CPUOffloadPolicy`); parameters are copied to ``device`` to compute.

    Raises:
        ValueError: the module has no trainable parameter.
    """
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("ZeRO-3 found no trainable parameter to shard")
    dp_mesh = device_mesh_of(dp_group, device)
    expert_mesh = device_mesh_of(expert_dp_group, device)
    common: dict[str, Any] = {
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if cpu_offload
        else OffloadPolicy(),
    }
    experts, blocks = wrapped_units(module)
    for stack in experts:
        fully_shard(stack, mesh=expert_mesh, reshard_after_forward=reshard_after_forward, **common)
        stack.set_gradient_divide_factor(float(dp_size))
        if device.type != "cuda":  # gloo has no PREMUL_SUM: sum, then divide
            stack.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **common)
    runner = StepRunner(module)
    fully_shard(runner, mesh=dp_mesh, reshard_after_forward=False, **common)
    return runner


def reduce_after_schedule(runner: StepRunner) -> None:
    """Reduce-scatter every unit's accumulated gradient once a pipeline schedule has run all
    its backwards with gradient sync off: the schedule calls ``torch.autograd.backward`` on
    stage activations per microbatch and chunk, so no single backward is every unit's last.
    This is what `torch.distributed.pipelining` does after its schedules (FSDP2's
    post-backward of each parameter group, then the root's end-of-backward callback)."""
    runner.set_is_last_backward(True)
    runner.set_requires_gradient_sync(True)
    state = fully_shard.state(runner)
    for unit_state in state._state_ctx.all_states:
        for group in unit_state._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def gathered_params(runner: StepRunner, params: Sequence[Tensor]) -> list[Tensor]:
    """FSDP2's gathered (unsharded) parameter for each of ``params`` (the sharded parameters
    the modules hold between forwards) that has been gathered once, else the parameter
    itself. The autograd graph of a forward records the gathered ones: a backward asked for
    weight gradients separately (a split backward's weight half) must name those."""
    state = fully_shard.state(runner)
    gathered: dict[int, Tensor] = {}
    for unit_state in state._state_ctx.all_states:
        for group in unit_state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                if hasattr(fsdp_param, "_unsharded_param"):
                    gathered[id(fsdp_param.sharded_param)] = fsdp_param._unsharded_param
    return [gathered.get(id(p), p) for p in params]
