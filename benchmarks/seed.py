"""Speed of the nano-train seed default configuration (examples/configs/nano_train_seed.yaml).

Times the model's training step (forward, backward, AdamW step; fp32, one CPU thread) on random
tokens of the config's batch 16 x 32 and prints ms/step and tokens/s. The model and its
optimizer are built the way `nanotrain fit` builds them from the config: a
`LanguageModelModule` from the config's `model.init_args` (so the config's `optimizer_impl`,
`recompute` and `compile_layers` apply), its `configure_model()` and the AdamW of its
`configure_optimizers()` (two parameter groups, the config's AdamW kernel; the LR schedule is
not stepped, gradients are not clipped). With `compile_layers` the first steps also compile:
their time is printed as warm-up. It uses whichever nanotrain is on PYTHONPATH, so two trees
can be compared side by side in one shell (both then read THIS script's config; a tree whose
LanguageModelModule lacks some of the config's arguments, such as `optimizer_impl` or
`compile_layers` before issue 18, runs without them and the line says which it ignored):

    for i in 1 2 3; do PYTHONPATH=/path/to/old python benchmarks/seed.py;
                       PYTHONPATH=$PWD python benchmarks/seed.py; done

`--compile none|layers|model` replaces the config's compile choice (its `compile_layers` and
`compile_model`), to compare eager, per-layer and whole-model compilation on one tree.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from pathlib import Path

import torch
import yaml

import nanotrain
from nanotrain import LanguageModelModule

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "configs" / "nano_train_seed.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up)")
    parser.add_argument(
        "--compile",
        choices=["config", "none", "layers", "model"],
        default="config",
        help="what to torch.compile (default: as the config says)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = yaml.safe_load(CONFIG.read_text())
    batch, seq = cfg["trainer"]["global_batch_size"], cfg["data"]["init_args"]["seq_len"]
    known = inspect.signature(LanguageModelModule.__init__).parameters
    init_args = cfg["model"]["init_args"]
    if args.compile != "config":
        init_args["compile_layers"] = args.compile == "layers"
        init_args["compile_model"] = args.compile == "model"
    ignored = sorted(set(init_args) - set(known))
    module = LanguageModelModule(**{k: v for k, v in init_args.items() if k in known})
    module.configure_model()
    model, config = module.model, module.config
    opt = module.configure_optimizers()["optimizer"]
    times = []
    warmup_start = time.perf_counter()
    for i in range(args.steps + 3):
        if i == 3:
            warmup = time.perf_counter() - warmup_start
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))
        t0 = time.perf_counter()
        out = model(tokens[:, :-1], tokens[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    where = Path(nanotrain.__file__).resolve().parent.parent
    kernel = next((k for k in ("fused", "foreach") if opt.defaults.get(k)), "default")
    print(
        f"{where}: {params:,} params, {ms:.1f} ms/step, {batch * seq / ms * 1e3:,.0f} tokens/s "
        f"(AdamW kernel: {kernel}; warm-up: 3 steps in {warmup:.1f} s)"
        + (f"; compile: {args.compile}" if args.compile != "config" else "")
        + (f"; this tree ignores {', '.join(ignored)}" if ignored else "")
    )


if __name__ == "__main__":
    main()
