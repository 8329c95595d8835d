"""What keeping the routed experts' saves in fp8 (`fp8_expert_activations`) does to training.

    python benchmarks/fp8_saves.py                 # about 3 minutes on 2 CPU cores
    python benchmarks/fp8_saves.py --max-steps 200

1. The gradient of one batch of the demo corpus (8 x 128 byte tokens) with and without fp8
   saves, from the same weights (recompute "light"): the relative error ||g8 - g|| / ||g|| of
   the routed experts' weights, of the other parameters and of all, per preset and precision.
2. The README's run, `nanotrain fit --config examples/configs/tiny_deepseek.yaml` (the path
   users run), with recompute "light", once as it is and once with `fp8_expert_activations`,
   each in its own process: every validation loss of both and their relative difference.
   Forward is exact under fp8 saves, so the difference is what the rounded gradients did to
   training (and to every step after them).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from nanotrain.models import build_model, presets
from nanotrain.models.expert_compute import GroupedExperts, set_fp8_expert_activations
from nanotrain.models.transformer import set_recompute
from nanotrain.precision import resolve_precision

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_deepseek.yaml"
VALIDATION = re.compile(r"validation at step (\d+) \| val/loss ([0-9.]+)")


def validation_losses(fp8: bool, max_steps: int) -> dict[int, float]:
    """step -> val/loss printed by one `nanotrain fit` run."""
    with tempfile.TemporaryDirectory() as root:
        command = [
            sys.executable, "-m", "nanotrain", "fit", "--config", str(CONFIG),
            "--trainer.max_steps", str(max_steps), "--trainer.default_root_dir", root,
            "--model.init_args.recompute", "light",
            "--model.init_args.fp8_expert_activations", str(fp8).lower(),
        ]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, check=True)
    return {int(s): float(v) for s, v in VALIDATION.findall(out.stdout + out.stderr)}


def demo_batch(batch: int = 8, seq_len: int = 128) -> torch.Tensor:
    """[batch, seq_len + 1] byte ids (+1: the byte tokenizer's offset) from the demo corpus."""
    from nanotrain.data.demo import demo_corpus_files

    data = b"".join(path.read_bytes() for path in demo_corpus_files()[:4])
    ids = torch.tensor(list(data[: batch * (seq_len + 1)]), dtype=torch.long) + 1
    return ids.view(batch, seq_len + 1)


def gradient_errors(preset: str, precision: str, against: str | None = None) -> dict[str, float]:
    """Relative L2 error of one batch's gradient with fp8 saves under `precision`, per
    parameter group; with `against`, of the gradient under `precision` (no fp8 saves) against
    the one under `against` instead (the scale of a precision's own rounding)."""
    torch.manual_seed(0)
    model = build_model(presets.get(preset, vocab_size=257)).train()
    set_recompute(model, "light")
    ids = demo_batch()
    experts = {
        id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    if against is None:
        runs = [(precision, False), (precision, True)]
    else:
        runs = [(against, False), (precision, False)]
    grads = []
    for name, fp8 in runs:
        plugin = resolve_precision(name)
        plugin.setup_module(model, torch.device("cpu"), is_global_zero=False)
        set_fp8_expert_activations(model, fp8)
        model.zero_grad(set_to_none=True)
        with plugin.forward_context():
            out = model(ids[:, :-1], ids[:, 1:])
        out.total_loss.backward()
        grads.append(
            {id(p): p.grad.float().clone() for p in model.parameters() if p.grad is not None}
        )
    exact, rounded = grads

    def error(keys: list[int]) -> float:
        diff = sum(float((rounded[k] - exact[k]).pow(2).sum()) for k in keys)
        norm = sum(float(exact[k].pow(2).sum()) for k in keys)
        return (diff / norm) ** 0.5

    routed = [k for k in exact if k in experts]
    return {
        "routed experts": error(routed),
        "other parameters": error([k for k in exact if k not in experts]),
        "all": error(list(exact)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=int, default=600)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("one batch's gradient, recompute light: relative error with fp8 saves")
    print("| preset | precision | routed experts | other parameters | all |")
    print("|---|---|---|---|---|")
    for preset in ("tiny", "deepseek-100m"):
        for precision in ("32-true", "bf16-mixed"):
            e = gradient_errors(preset, precision)
            print(f"| {preset} | {precision} | {e['routed experts']:.2e} "
                  f"| {e['other parameters']:.2e} | {e['all']:.2e} |")  # fmt: skip
        e = gradient_errors(preset, "bf16-mixed", against="32-true")
        print(f"| {preset} | bf16-mixed against 32-true, no fp8 saves | "
              f"{e['routed experts']:.2e} | {e['other parameters']:.2e} | {e['all']:.2e} |")  # fmt: skip
    print()
    plain = validation_losses(False, args.max_steps)
    fp8 = validation_losses(True, args.max_steps)
    print(f"tiny_deepseek.yaml, recompute light, {args.max_steps} steps")
    print("| step | val/loss | val/loss, fp8 expert saves | relative difference |")
    print("|---|---|---|---|")
    for step in sorted(plain):
        a, b = plain[step], fp8[step]
        print(f"| {step} | {a:.4f} | {b:.4f} | {(b - a) / a:+.2e} |")


if __name__ == "__main__":
    main()
