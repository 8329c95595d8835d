"""Speed of the nano-train seed default configuration (examples/configs/nano_train_seed.yaml).

Times the model's training step (forward, backward, AdamW step; fp32, one CPU thread) on random
tokens of the config's batch 16 x 32 and prints ms/step and tokens/s. It uses whichever
nanotrain is on PYTHONPATH, so two trees can be compared side by side in one shell:

    for i in 1 2 3; do PYTHONPATH=/path/to/old python benchmarks/seed.py;
                       PYTHONPATH=$PWD python benchmarks/seed.py; done
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import yaml

import nanotrain
from nanotrain.models import build_model, presets

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "configs" / "nano_train_seed.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = yaml.safe_load(CONFIG.read_text())
    overrides = cfg["model"]["init_args"]["model_overrides"]
    config = presets.get(cfg["model"]["init_args"]["model"], **overrides)
    batch, seq = cfg["trainer"]["global_batch_size"], cfg["data"]["init_args"]["seq_len"]
    model = build_model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range(args.steps + 3):
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
    print(f"{where}: {params:,} params, {ms:.1f} ms/step, {batch * seq / ms * 1e3:,.0f} tokens/s")


if __name__ == "__main__":
    main()
