"""Activation memory per microbatch with and without activation recomputation.

    python benchmarks/recompute.py --preset deepseek-100m --batch 1 --seq-len 512

Counts the bytes autograd keeps for backward during one training forward (each distinct
tensor storage once, via `saved_tensors_hooks`), for recompute None, "light", "selective" and "full",
and for None and "light" with the routed experts' rows and SwiGLU inputs kept in fp8
(`fp8_expert_activations`); then times forward + backward of each (fp32, CPU, one thread: a
rough cost of recomputing). Parameters themselves are not counted.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd.graph import saved_tensors_hooks

from nanotrain.models import build_model, presets
from nanotrain.models.expert_compute import set_fp8_expert_activations
from nanotrain.models.transformer import set_recompute


def measure(
    model: torch.nn.Module, ids: torch.Tensor, mode: str | None, fp8: bool = False
) -> tuple[float, float]:
    """(MiB of activations saved during forward, seconds of forward + backward)."""
    set_recompute(model, mode)
    set_fp8_expert_activations(model, fp8)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    t0 = time.perf_counter()
    with saved_tensors_hooks(pack, lambda t: t):
        out = model(ids[:, :-1], ids[:, 1:])
    out.total_loss.backward()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return sum(seen.values()) / 2**20, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="deepseek-100m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = presets.get(args.preset)
    model = build_model(config).train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1))
    print(f"{args.preset}, micro-batch {args.batch} x {args.seq_len}, fp32")
    print("| recompute | activations MiB | vs none | fwd+bwd s |")
    print("|---|---|---|---|")
    base = None
    for mode, fp8 in ((None, False), ("light", False), ("selective", False), ("full", False),
                      (None, True), ("light", True)):  # fmt: skip
        mib, s = measure(model, ids, mode, fp8)
        base = base or mib
        name = f"{mode} + fp8 experts" if fp8 else mode
        print(f"| {name} | {mib:.1f} | {mib / base:.2f} | {s:.2f} |")


if __name__ == "__main__":
    main()
