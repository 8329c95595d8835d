"""Activation memory per microbatch with and without activation recomputation, beside the
planner's figure.

    python benchmarks/recompute.py --preset deepseek-100m --batch 1 --seq-len 512
    python benchmarks/recompute.py --device cuda --precision bf16-mixed   # on a GPU

Counts the bytes autograd keeps for backward during one training forward (each distinct
tensor storage once, via `saved_tensors_hooks`), for recompute None, "light", "selective" and "full",
and for None and "light" with the routed experts' rows and SwiGLU inputs kept in fp8
(`fp8_expert_activations`), next to what `nanotrain.planning.activation_estimate` predicts for
the same model, batch, precision and device; then times forward + backward of each (a rough
cost of recomputing; CPU: one thread). Parameters themselves are not counted. On a GPU this
measures what the planner assumes there and the CPU cannot show: what the flash attention
kernels and the grouped-GEMM experts save.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd.graph import saved_tensors_hooks

from nanotrain.models import build_model, presets
from nanotrain.models.expert_compute import set_fp8_expert_activations
from nanotrain.models.transformer import set_recompute
from nanotrain.planning.activations import activation_estimate
from nanotrain.planning.layout import PlanLayout, Workload
from nanotrain.precision import resolve_precision

MODES = ((None, False), ("light", False), ("selective", False), ("full", False),
         (None, True), ("light", True))  # fmt: skip


def measure(
    model: torch.nn.Module, plugin, ids: torch.Tensor, mode: str | None, fp8: bool = False
) -> tuple[int, float]:
    """(bytes of activations saved during forward, seconds of forward + backward)."""
    set_recompute(model, mode)
    set_fp8_expert_activations(model, fp8)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with saved_tensors_hooks(pack, lambda t: t), plugin.forward_context():
        out = model(ids[:, :-1], ids[:, 1:])
    out.total_loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return sum(seen.values()), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="deepseek-100m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="32-true")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    config = presets.get(args.preset)
    model = build_model(config, device=device).train()
    plugin = resolve_precision(args.precision)
    plugin.setup_module(model, device, is_global_zero=False)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1), device=device)
    print(f"{args.preset}, micro-batch {args.batch} x {args.seq_len}, {args.precision}, {device}")
    print(
        "| recompute | activations MiB | vs none | planner MiB | planner / measured | fwd+bwd s |"
    )
    print("|---|---|---|---|---|---|")
    base = None
    for mode, fp8 in MODES:
        nbytes, s = measure(model, plugin, ids, mode, fp8)
        base = base or nbytes
        layout = PlanLayout(recompute=mode, fp8_expert_activations=fp8)
        workload = Workload(args.seq_len, args.batch, args.batch, args.precision)
        planned = activation_estimate(config, layout, workload, device=device.type)
        predicted = planned.per_microbatch
        name = f"{mode} + fp8 experts" if fp8 else mode
        print(f"| {name} | {nbytes / 2**20:.1f} | {nbytes / base:.2f} | "
              f"{predicted / 2**20:.1f} | {predicted / nbytes:.4f} | {s:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
