"""The routed experts (`GroupedExperts`) and how their SwiGLU MLPs are computed on token
copies sorted by expert.

Three paths give the same result for `GroupedExperts.forward`:

* `looped_swiglu` (every device and dtype): the stacked weights [E, out, in] are split into E
  views ONCE per call (`unbind`), then each expert runs three matmuls on its slice of rows.
  Indexing the stack per expert (`w[e]`) instead would make autograd build a zero-filled
  gradient of the whole stack for every expert, a cost quadratic in E; `unbind`'s backward
  stacks the E gradients once, so the cost is linear in E. It needs the slice sizes as host
  integers (one `tolist()` when they come as a tensor).
* `batched_swiglu` (every expert has the same number of rows, e.g. balanced routing): the rows
  are a [E, C, H] view and each of the nine GEMMs of forward + backward is ONE `torch.bmm` over
  all experts, inside one autograd Function, so the number of ops (and their per-call cost)
  does not grow with E. Its backward writes each weight gradient once, in the stack's own
  [E, out, in] layout (no per-expert pieces to stack, no transposed copies).
* `grouped_swiglu` (`torch.nn.functional.grouped_mm`: CUDA bf16, or CPU fp32 / bf16 where the
  installed torch runs it): three grouped GEMMs over all experts at once with offsets from the
  cumulative counts. On CUDA the offsets stay on the device, so the expert computation never
  waits for the host; on CPU it runs unequal groups (dropless routing) about twice as fast as
  the loop at 128 experts, with no Python loop over the experts.

`GroupedExperts.forward` picks: CUDA grouped GEMM without reading the sizes; else, with the
sizes on the host (free on CPU), batched GEMMs for equal groups, the grouped GEMM for unequal
ones, the loop where neither runs (the fp8/fp4 emulations, unaligned widths). Under autocast
(bf16-mixed) x and the weights are first cast to autocast's dtype, as autocast would cast each
matmul's inputs, so the same paths run there too.

Shape comments: M rows (token copies) sorted by expert, M_e expert e's rows, E experts (this
rank's local ones in `GroupedExperts`), C rows per expert on the batched path, H hidden, I an
expert's width (moe_intermediate_size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.models.cast_cache import cached_cast
from nanotrain.models.fp8_saves import (
    Fp8Saves,
    check_flag,
    check_fp8_expert_activations,
    keep_in_fp8,
)
from nanotrain.models.layers import swiglu_down
from nanotrain.parallel.expert import expert_range, mark_expert_params


def grouped_mm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `grouped_swiglu` can run on x and the stacked weights: a torch with
    `F.grouped_mm`, x and the weights of one dtype, and
      - on CUDA: bf16 on a device of compute capability 8.0 or newer (torch's CUTLASS
        kernels, which take the offsets on the device, run on 9.x and 10.x; on older GPUs
        torch's fallback copies the offsets to the host, a sync, and loops in C++);
      - on CPU: fp32 or bf16, where the installed torch implements it (probed at import);
        bf16 only inside torch.compile, whose shape function refuses fp32.
    The kernels need every row stride to be a multiple of 16 bytes: hidden and expert width
    multiples of 8 in bf16, of 4 in fp32.
    """
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype:
        return False
    per_16_bytes = 16 // x.element_size()
    if weight.shape[-1] % per_16_bytes or weight.shape[-2] % per_16_bytes:
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # torch.compile's shape function for grouped_mm refuses fp32 (torch 2.13)
    return x.device.type == "cpu" and x.dtype in CPU_GROUPED_MM_DTYPES


def _cpu_grouped_mm_runs(dtype: torch.dtype) -> bool:
    """Whether this torch computes `F.grouped_mm` (with its backward) on CPU in `dtype`."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 8, 8, dtype=dtype, requires_grad=True)
        offs = torch.tensor([2, 4], dtype=torch.int32)
        F.grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(torch.ones(4, 8, dtype=dtype))
    except (RuntimeError, NotImplementedError):
        return False
    return bool(w.grad is not None and (w.grad == 2).all())  # each weight sees 2 rows of ones


# Probed at import (a few tiny GEMMs), not at first use: the first use may be inside a
# torch.compile trace, which would have to trace the probe too.
CPU_GROUPED_MM_DTYPES = frozenset(
    d for d in (torch.float32, torch.bfloat16) if _cpu_grouped_mm_runs(d)
)


def looped_swiglu(
    x: torch.Tensor,
    sizes: Sequence[int],
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    rebuild: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert SwiGLU on row slices, linear in the number of experts.

    Args: x [M, H] rows sorted by expert; sizes: E host ints summing to M;
        gate_proj, up_proj [E, I, H]; down_proj [E, H, I]; rebuild: make the activation
        again in backward (`swiglu_down`); scale: optional [M, 1] per-row factor of the
        activation (the rows' gate weights).
    Returns: [M, H].
    """
    # E views each: gates and ups (I, H), downs (H, I)
    gates, ups, downs = gate_proj.unbind(0), up_proj.unbind(0), down_proj.unbind(0)
    scales = [None] * len(sizes) if scale is None else scale.split(list(sizes), dim=0)
    outputs = []
    for e, x_e in enumerate(x.split(list(sizes), dim=0)):  # x_e: (M_e, H)
        # an expert with no rows still runs (on 0 rows): its weights then get a zero gradient
        # instead of none, so every rank's graph, and hence its backward collectives, has the
        # same shape whatever the routing
        g, u = x_e @ gates[e].T, x_e @ ups[e].T  # (M_e, I) each
        down = lambda a, w=downs[e].T: a @ w  # noqa: E731
        outputs.append(swiglu_down(g, u, down, rebuild, scales[e]))  # (M_e, H)
    return torch.cat(outputs, dim=0)  # (M, H)


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    rebuild: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU of every expert by three grouped GEMMs with device offsets (no host sync).

    Args: x [M, H] rows sorted by expert (see `grouped_mm_available` for devices and dtypes);
        counts [E] integer tensor on x's device; gate_proj, up_proj [E, I, H];
        down_proj [E, H, I] (x's dtype); rebuild: make the activation again in backward
        (`swiglu_down`); scale: optional [M, 1] per-row factor of the activation.
    Returns: [M, H].
    """
    # offs[i] = end row of expert i (int32, non-decreasing); out = x_e @ W_e^T per group, so the
    # right operand is the stack transposed to [E, in, out]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,)
    g = F.grouped_mm(x, gate_proj.transpose(-2, -1), offs=offs)  # (M, I)
    u = F.grouped_mm(x, up_proj.transpose(-2, -1), offs=offs)  # (M, I)
    w_down = down_proj.transpose(-2, -1)

    def down(a: torch.Tensor) -> torch.Tensor:
        return F.grouped_mm(a, w_down, offs=offs)  # (M, H)

    return _DenseGrad.apply(swiglu_down(g, u, down, rebuild, scale))


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: grouped_mm's backward refuses the
    expanded stride-0 gradient that e.g. `y.sum()` produces."""

    @staticmethod
    def forward(ctx, y):  # noqa: ANN001, ANN205
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad.contiguous()


def _as_autocast_would(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Under autocast, x and the weight stacks in autocast's dtype, as autocast casts every
    matmul's inputs (bf16-mixed: x arrives in fp32 from the norm, the weights are fp32), so
    the grouped GEMM, which needs one dtype, can run (on CUDA it is the path without a host
    sync). Unchanged without autocast, or under a torch-function mode (the fp8/fp4
    emulations intercept the loop's matmuls themselves)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or torch._C._is_torch_function_mode_enabled():
        return x, weights
    dtype = torch.get_autocast_dtype(device)
    tensors = (x, *weights)
    if any(t.dtype not in (torch.float32, dtype) for t in tensors) or all(
        t.dtype == dtype for t in tensors
    ):
        return x, weights  # autocast casts fp32 only (fp64 stays fp64), or nothing to cast
    # the weights' casts once per step (`cast_cache`), as autocast caches its own
    return x.to(dtype), tuple(cached_cast(w, dtype) for w in weights)


def reads_sizes_first(x: torch.Tensor) -> bool:
    """Whether expert code reads sizes on the host before choosing a path: on CPU the read
    costs nothing, so `GroupedExperts` reads the group sizes (equal groups run fastest
    batched) and capacity dispatch under ep exchanges slot counts in training too (ranks may
    hold batches of different shapes); on CUDA a read would wait for the device, so the
    grouped GEMM takes the counts as device offsets unread and training trusts one shape."""
    return not x.is_cuda


def equal_group_rows(sizes: Sequence[int]) -> int | None:
    """The common group size when every expert has the same number of rows (> 0), else None."""
    if not sizes or sizes[0] == 0 or any(n != sizes[0] for n in sizes):
        return None
    return int(sizes[0])


class _BatchedSwiGLU(torch.autograd.Function):
    """SwiGLU of E experts with C rows each as batched GEMMs; see `batched_swiglu`."""

    @staticmethod
    def forward(ctx, x, num_experts, gate_proj, up_proj, down_proj, rebuild, scale):  # noqa: ANN001, ANN205
        xb = x.view(num_experts, -1, x.shape[-1])  # (E, C, H), no copy
        g = torch.bmm(xb, gate_proj.transpose(1, 2))  # (E, C, I)
        u = torch.bmm(xb, up_proj.transpose(1, 2))  # (E, C, I)
        keep_in_fp8(g), keep_in_fp8(u)  # as `swiglu_down` does, inside an open `Fp8Saves`
        sg = F.silu(g)
        a = sg * u
        sb = None if scale is None else scale.view(num_experts, -1, 1)  # (E, C, 1)
        z = a if sb is None else a * sb  # what the down projection reads
        y = torch.bmm(z, down_proj.transpose(1, 2))  # (E, C, H)
        # the same activations the per-expert autograd graph keeps (g, silu(g), u, a, and
        # with a scale the scaled product; x is the caller's), so switching paths changes
        # neither memory nor recompute; with `rebuild` (recompute "light") silu(g), a and the
        # scaled product are made again in backward
        ctx.rebuild, ctx.scaled = rebuild, sb is not None
        kept = (x, g, u) if rebuild else (x, g, u, sg, a) + (() if sb is None else (z,))
        # x and the scale themselves are saved, not their views `xb` / `sb`: a saved view of an
        # input is an alias that torch.compile's autograd.Function tracing refuses to carry
        # out of the graph
        ctx.num_experts = num_experts
        saved_scale = () if scale is None else (scale,)
        ctx.save_for_backward(*kept, *saved_scale, gate_proj, up_proj, down_proj)
        return y.view(x.shape)  # (E*C, H)

    @staticmethod
    def backward(ctx, grad_y):  # noqa: ANN001, ANN205
        saved = list(ctx.saved_tensors)
        gate_proj, up_proj, down_proj = saved[-3:]
        sb = saved[-4].view(ctx.num_experts, -1, 1) if ctx.scaled else None  # (E, C, 1)
        if ctx.rebuild:
            x, g, u = saved[:3]
            sg = F.silu(g)
            a = sg * u
            z = a if sb is None else a * sb
        else:
            x, g, u, sg, a = saved[:5]
            z = saved[5] if ctx.scaled else a
        xb = x.view(ctx.num_experts, -1, x.shape[-1])  # (E, C, H)
        # a gradient from e.g. y.sum() is an expanded (stride 0) view: the GEMMs want rows
        dy = grad_y.contiguous().view(a.shape[0], a.shape[1], -1)  # (E, C, H)
        # each weight gradient is computed in its parameter's layout, as autograd's mm does
        # per expert (grad_out^T @ input): [E, out, in] written once, nothing to transpose
        grad_down = torch.bmm(dy.transpose(1, 2), z)  # (E, H, I)
        da = torch.bmm(dy, down_proj)  # (E, C, I): the scaled product's gradient so far
        grad_scale = None
        if sb is not None:
            grad_scale = (da * a).sum(-1, keepdim=True).view(-1, 1)  # (E*C, 1)
            da = da * sb
        dg = torch.ops.aten.silu_backward(da * u, g)
        du = da.mul_(sg)  # da's last use: no new buffer
        grad_gate = torch.bmm(dg.transpose(1, 2), xb)  # (E, I, H)
        grad_up = torch.bmm(du.transpose(1, 2), xb)  # (E, I, H)
        # the second product accumulates into the first inside the GEMM (no temporary)
        dx = torch.bmm(dg, gate_proj).baddbmm_(du, up_proj)  # (E, C, H)
        grads = (dx.view(-1, xb.shape[-1]), None, grad_gate, grad_up, grad_down, None)
        return (*grads, grad_scale)  # dx: (E*C, H)


def batched_swiglu(
    x: torch.Tensor,
    num_experts: int,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    rebuild: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU of E experts that all get C rows, by batched GEMMs (a constant number of ops).

    Args: x [E*C, H] rows sorted by expert (contiguous); num_experts: E;
        gate_proj, up_proj [E, I, H]; down_proj [E, H, I]; rebuild: keep gate and up only,
        and make the activation again in backward; scale: optional [E*C, 1] per-row factor
        of the activation (the rows' gate weights).
    Returns: [E*C, H].
    """
    x = x.contiguous()
    scale = None if scale is None else scale.contiguous()
    return _BatchedSwiGLU.apply(x, num_experts, gate_proj, up_proj, down_proj, rebuild, scale)


class GroupedExperts(nn.Module):
    """The routed experts this rank holds: SwiGLU MLPs with stacked weights.

    Under expert parallelism (`ep_size` > 1) this is the slice of global experts
    ``[expert_offset, expert_offset + num_local_experts)`` of all `num_experts`; the stacked
    weights' dim 0 is that slice (`ep_partition_dims`), so initialization and checkpoints
    can map it to and from the full stack.

    Parameters (HF layout): gate_proj, up_proj [E_local, moe_inter, H];
    down_proj [E_local, H, moe_inter].
    Shapes: forward(x [M, H] sorted by local expert, counts [E_local] tensor or ints,
    scale [M] or None) -> [M, H]. `scale`, the rows' gate weights, multiplies each row's
    activation before the down projection (so the output is already weighted).

    With `fp8_saved_activations` (`set_fp8_expert_activations`) what backward keeps of the
    rows and of the SwiGLU's inputs (gate and up outputs) is stored in fp8 with 1 x 128 tile
    scales (`nanotrain.models.fp8_saves`); the output is unchanged, the gradients read the
    rounded values.
    """

    ep_partition_dims = {"gate_proj": 0, "up_proj": 0, "down_proj": 0}

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        *,
        ep_size: int = 1,
        ep_rank: int = 0,
        device: Any = None,
    ):
        super().__init__()
        start, stop = expert_range(num_experts, ep_size, ep_rank)
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.expert_offset, self.num_local_experts = start, stop - start
        e = self.num_local_experts
        self.gate_proj = nn.Parameter(torch.empty(e, inter, hidden, device=device))
        self.up_proj = nn.Parameter(torch.empty(e, inter, hidden, device=device))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inter, device=device))
        self.rebuild_activation = False  # recompute "light" (`set_recompute`)
        self.fp8_saved_activations = False  # `set_fp8_expert_activations`

    def _apply(self, fn: Any, recurse: bool = True) -> GroupedExperts:
        # Materializing from meta (`to_empty`) or converting may replace the Parameter
        # objects, which drops the expert tag the strategy looks for: put it back.
        out = super()._apply(fn, recurse)
        mark_expert_params(self)
        return out

    def full_shape(self, name: str) -> tuple[int, ...]:
        """Shape of parameter `name` stacked over all `num_experts` experts."""
        return (self.num_experts, *getattr(self, name).shape[1:])

    def shard_full_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's experts (rows [expert_offset, + num_local_experts)) of full stacks."""
        stop = self.expert_offset + self.num_local_experts
        return {name: t[self.expert_offset : stop] for name, t in full.items()}

    #: set by a precision plugin that runs these experts its own way
    #: (`nanotrain.precision.base.wrap_forward`)
    runs_own_precision = False
    #: whether the routed copies cross the ep group in fp8 with 1 x 128 tile scales
    #: (`nanotrain.parallel.fp8_wire`; without expert parallelism they are rounded as the
    #: wire would), set by `set_fp8_dispatch` or by an fp8 precision that quantizes these
    #: experts' inputs per tile anyway (`EmulatedFP8`)
    dispatches_fp8 = False

    def for_dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, H] in the dtype these experts' GEMMs read it in, to send it to their ranks
        in: under autocast an fp32 x goes out in autocast's dtype, the cast `forward` would
        make on arrival (`_as_autocast_would`), so the experts compute bitwise what they would
        from fp32 at half the dispatch bytes; the cast's backward returns the gradient in fp32
        before the copies' gradients are summed, as before. Unchanged without autocast, and
        when a precision plugin runs these experts its own way (kept high, or an emulated
        low precision that quantizes the fp32 input)."""
        if self.runs_own_precision:
            return x
        return _as_autocast_would(x, ())[0]

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor | Sequence[int],
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # CUDA bf16: grouped GEMMs with device offsets, no host sync. Elsewhere the sizes come
        # to the host (one tolist() when they are a tensor, free on CPU): equal groups run as
        # batched GEMMs (a constant number of ops), others as grouped GEMMs where torch runs
        # them, else as a loop over the experts, linear in their number. See
        # `nanotrain.models.expert_compute`.
        x, weights = _as_autocast_would(x, (self.gate_proj, self.up_proj, self.down_proj))
        if scale is not None:  # (M, 1) in the activation's dtype; its gradient returns in fp32
            scale = scale.to(x.dtype)[:, None]
        if not self.fp8_saved_activations:
            return self._swiglu(x, counts, weights, scale)
        with Fp8Saves() as saves:
            return self._swiglu(saves.keep(x), counts, weights, scale)

    def _swiglu(
        self,
        x: torch.Tensor,
        counts: torch.Tensor | Sequence[int],
        weights: tuple[torch.Tensor, ...],
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        rebuild = self.rebuild_activation
        grouped = grouped_mm_available(x, weights[0]) and self._kernels_allowed(x)
        if grouped and isinstance(counts, torch.Tensor) and not reads_sizes_first(x):
            return grouped_swiglu(x, counts, *weights, rebuild, scale)
        sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        if equal_group_rows(sizes) is not None and self._kernels_allowed(x):
            return batched_swiglu(x, len(sizes), *weights, rebuild, scale)
        if grouped:
            offsets_from = counts if isinstance(counts, torch.Tensor) else torch.tensor(sizes)
            return grouped_swiglu(x, offsets_from.to(x.device), *weights, rebuild, scale)
        return looped_swiglu(x, sizes, *weights, rebuild, scale)

    @staticmethod
    def _kernels_allowed(x: torch.Tensor) -> bool:
        # The fp8/fp4 emulations' torch-function mode intercepts the loop's per-expert
        # `x @ W.T`: under it keep the loop, so it sees the form it handles. Under autocast
        # x and the weights are already in autocast's dtype (`_as_autocast_would`), so the
        # batched and grouped GEMMs compute what autocast's per-expert matmuls would.
        # (torch.compile traces the batched Function.)
        if torch._C._is_torch_function_mode_enabled():
            return False
        device = x.device.type
        return not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) == x.dtype


def set_fp8_expert_activations(model: nn.Module, enabled: bool) -> int:
    """Keep (or stop keeping) what every routed-expert module in `model` saves of its rows and
    SwiGLU inputs in fp8 (`GroupedExperts.fp8_saved_activations`); returns how many modules
    were set. Layers that recompute "full" keep nothing of them either way.

    Raises:
        TypeError: for an `enabled` that is not a bool.
    """
    check_fp8_expert_activations(enabled, compiled=False)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in experts:
        m.fp8_saved_activations = enabled
    return len(experts)


def set_fp8_dispatch(model: nn.Module, enabled: bool) -> int:
    """Send the routed copies of every routed-expert module in `model` to their experts in
    fp8 with 1 x 128 tile scales, DeepSeek-V3's dispatch (`GroupedExperts.dispatches_fp8`;
    the combine returns in the experts' output dtype); returns how many modules were set.
    With `enabled` false the precision decides ("fp8-emulated" dispatches in fp8).

    Raises:
        TypeError: for an `enabled` that is not a bool.
    """
    check_flag("fp8_dispatch", enabled)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in experts:
        m.dispatches_fp8 = enabled or m.dispatches_fp8
    return len(experts)
