"""ModelDump: a model summary at fit start, and weight/gradient/activation statistics at chosen
steps, written to files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from nanotrain.callbacks.base import Callback

if TYPE_CHECKING:
    from nanotrain.module import NanoModule
    from nanotrain.trainer import Trainer


def tensor_stats(tensor: Tensor) -> dict[str, Any]:
    """Statistics of one tensor, computed in float32 or wider.

    Returns {"shape", "dtype", "numel", "mean", "std" (population: divides by numel),
    "absmax", "zero_fraction", "norm" (L2 of all entries)}; the float values are NaN for an
    empty tensor.
    """
    t = tensor.detach()
    x = t.double() if t.dtype == torch.float64 else t.float()
    n = x.numel()
    if n == 0:
        nan = float("nan")
        values = dict(mean=nan, std=nan, absmax=nan, zero_fraction=nan, norm=nan)
    else:
        # One stack and one host transfer for all five numbers.
        numbers = torch.stack(
            [
                x.mean(),
                x.std(correction=0),
                x.abs().max(),
                (x == 0).sum().to(x.dtype) / n,
                torch.linalg.vector_norm(x),
            ]
        ).tolist()
        values = dict(zip(("mean", "std", "absmax", "zero_fraction", "norm"), numbers, strict=True))
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "numel": n,
        **values,
    }


class _RunningStats:
    """Statistics of every value a module output takes over several microbatches, accumulated
    as float64 sums on the device (no host sync until `result`)."""

    def __init__(self) -> None:
        self.count = 0
        self.sums: Tensor | None = None  # [sum, sum of squares, absmax, zeros]
        self.shape: list[int] = []
        self.dtype = ""

    def add(self, tensor: Tensor) -> None:
        x = tensor.detach().double()
        sums = torch.stack([x.sum(), (x * x).sum(), x.abs().max(), (x == 0).sum().double()])
        if self.sums is None:
            self.sums = sums
        else:
            self.sums = torch.stack(
                [
                    self.sums[0] + sums[0],
                    self.sums[1] + sums[1],
                    torch.maximum(self.sums[2], sums[2]),
                    self.sums[3] + sums[3],
                ]
            )
        self.count += x.numel()
        self.shape, self.dtype = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")

    def result(self) -> dict[str, Any]:
        total, squares, absmax, zeros = self.sums.tolist()
        n = self.count
        mean = total / n
        return {
            "shape": self.shape,  # of the last microbatch's output
            "dtype": self.dtype,
            "numel": n,
            "mean": mean,
            "std": max(squares / n - mean * mean, 0.0) ** 0.5,
            "absmax": absmax,
            "zero_fraction": zeros / n,
            "norm": squares**0.5,
        }


def first_tensor(output: Any) -> Tensor | None:
    """The first floating-point tensor in a module's output (tensor, tuple/list, dict, or
    dataclass such as a model-output record); None when there is none."""
    if isinstance(output, Tensor):
        return output if output.is_floating_point() else None
    if hasattr(output, "__dataclass_fields__"):
        output = [getattr(output, f) for f in output.__dataclass_fields__]
    elif isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def model_summary(module: nn.Module) -> dict[str, Any]:
    """Per-module parameter counts and per-parameter shapes, dtypes and trainability.

    Counts and shapes are those of the parameters this process holds (the whole model under
    single-device and DDP). Returns {"modules": [{"name", "type", "parameters" (own, not
    recursive), "trainable", "frozen"}], "parameters": [{"name", "shape", "dtype",
    "trainable"}], "total_parameters", "trainable_parameters", "frozen_parameters"}.
    """
    modules = []
    for name, sub in module.named_modules():
        own = list(sub.parameters(recurse=False))
        if not own:
            continue
        trainable = sum(p.numel() for p in own if p.requires_grad)
        frozen = sum(p.numel() for p in own if not p.requires_grad)
        modules.append(
            {
                "name": name or "(root)",
                "type": type(sub).__name__,
                "parameters": trainable + frozen,
                "trainable": trainable,
                "frozen": frozen,
            }
        )
    params = [
        {
            "name": name,
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),
            "trainable": p.requires_grad,
        }
        for name, p in module.named_parameters()
    ]
    trainable = sum(m["trainable"] for m in modules)
    frozen = sum(m["frozen"] for m in modules)
    return {
        "modules": modules,
        "parameters": params,
        "total_parameters": trainable + frozen,
        "trainable_parameters": trainable,
        "frozen_parameters": frozen,
    }


def _summary_table(summary: dict[str, Any]) -> str:
    lines = [f"{'module':<48} {'type':<24} {'params':>14} {'trainable':>14}"]
    for row in summary["modules"]:
        lines.append(
            f"{row['name']:<48} {row['type']:<24} {row['parameters']:>14,} {row['trainable']:>14,}"
        )
    lines.append(f"total parameters:     {summary['total_parameters']:,}")
    lines.append(
        f"trainable / frozen:   {summary['trainable_parameters']:,} / "
        f"{summary['frozen_parameters']:,}"
    )
    lines.append(f"active parameters:    {summary['active_parameters']:,}")
    flops = summary["flops_per_token"]
    lines.append(f"training FLOPs/token: {flops:.4g}" if flops else "training FLOPs/token: unknown")
    return "\n".join(lines)


class ModelDump(Callback):
    """Writes a model summary when fitting starts and tensor statistics at chosen steps.

    At fit start, rank 0 writes `<run_dir>/model_summary.json` and `model_summary.txt`
    (`model_summary`, plus "active_parameters" — the module's `active_parameter_count()` if it
    has one, else the total — and "flops_per_token" from `flops_per_token()`), and logs the
    table as text `model/summary`.

    At each step N in `steps` (N = `trainer.global_step` once the step completes, as
    checkpoints are named; the step's logged records carry Lightning's 0-based N - 1),
    into `<run_dir>/dumps/step_<N>/`:
        - weights.json, grads.json (rank 0): {"step", "tensors": {parameter: tensor_stats}}
          of every trainable parameter's full value (`strategy.full_tensor`) and gradient,
          taken in `on_before_optimizer_step`: weights before the update, gradients
          accumulated and reduced, before clipping (as Lightning's `on_before_optimizer_step`).
        - activations.rank<R>.json (every rank): {"step", "rank", "modules": {module:
          stats}}, the statistics of each module's output (first floating tensor) over all of
          this rank's microbatches of the step: what this rank computed, not a global view.
        - with `save_tensors`: tensors.safetensors (rank 0; "weight/<p>", "grad/<p>") and
          activations.rank<R>.safetensors (each module's output on the first microbatch).

    Args:
        steps: the step numbers to dump at (>= 1); empty for the summary only.
        save_tensors: also save the raw tensors with safetensors (large!).
        summary: write the summary at fit start.

    Raises:
        ValueError: for a step number < 1.
    """

    def __init__(
        self, steps: Iterable[int] = (), save_tensors: bool = False, summary: bool = True
    ) -> None:
        self.steps = sorted({int(s) for s in steps})
        if self.steps and self.steps[0] < 1:
            raise ValueError(f"dump steps are step numbers >= 1, got {self.steps[0]}")
        self.save_tensors = save_tensors
        self.summary = summary
        self._hooks: list[Any] = []
        self._activations: dict[str, _RunningStats] = {}
        self._first_outputs: dict[str, Tensor] = {}

    def dump_dir(self, trainer: Trainer, step: int) -> Path:
        """Where the dump of `step` goes."""
        return trainer.run_dir / "dumps" / f"step_{step}"

    # -- summary -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: NanoModule) -> None:
        """Write the model summary (rank 0)."""
        if not self.summary or not trainer.is_global_zero:
            return
        summary = model_summary(module)
        active = getattr(module, "active_parameter_count", None)
        summary["active_parameters"] = (
            int(active()) if callable(active) else summary["total_parameters"]
        )
        summary["flops_per_token"] = module.flops_per_token()
        table = _summary_table(summary)
        (trainer.run_dir / "model_summary.json").write_text(json.dumps(summary, indent=1))
        (trainer.run_dir / "model_summary.txt").write_text(table + "\n")
        trainer.loggers.log_text("model/summary", f"```\n{table}\n```", trainer.logged_step)

    # -- activations ---------------------------------------------------------------------------
    def on_train_step_start(
        self, trainer: Trainer, module: NanoModule, microbatches: list[Any], step_idx: int
    ) -> None:
        """Arm forward hooks for this step's forward passes if it is a dump step."""
        if trainer.global_step + 1 not in self.steps:
            return
        self._activations, self._first_outputs = {}, {}
        for name, sub in module.named_modules():
            self._hooks.append(sub.register_forward_hook(self._recorder(name or "(root)")))

    def _recorder(self, name: str):
        def record(sub: nn.Module, args: Any, output: Any) -> None:
            tensor = first_tensor(output)
            if tensor is None:
                return
            self._activations.setdefault(name, _RunningStats()).add(tensor)
            if self.save_tensors and name not in self._first_outputs:
                self._first_outputs[name] = tensor.detach().to("cpu", copy=True).contiguous()

        return record

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- weights and gradients -----------------------------------------------------------------
    def on_before_optimizer_step(
        self, trainer: Trainer, module: NanoModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """On a dump step: stop recording activations and write every file of the dump."""
        step = trainer.global_step + 1
        if step not in self.steps:
            return
        self._disarm()
        out_dir = self.dump_dir(trainer, step)
        out_dir.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        activations = {name: acc.result() for name, acc in self._activations.items()}
        _write_json(
            out_dir / f"activations.rank{rank}.json",
            {"step": step, "rank": rank, "modules": activations},
        )
        if self.save_tensors and self._first_outputs:
            _save_safetensors(out_dir / f"activations.rank{rank}.safetensors", self._first_outputs)
        self._activations, self._first_outputs = {}, {}
        self._dump_parameters(trainer, module, step, out_dir)

    def _dump_parameters(
        self, trainer: Trainer, module: NanoModule, step: int, out_dir: Path
    ) -> None:
        weights: dict[str, Any] = {}
        grads: dict[str, Any] = {}
        tensors: dict[str, Tensor] = {}
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            # full_tensor may be a collective under sharded layouts: every rank calls it.
            full = trainer.strategy.full_tensor(name, param.data)
            weights[name] = tensor_stats(full)
            if self.save_tensors:
                tensors[f"weight/{name}"] = full.detach().cpu()
            if param.grad is not None:
                full_grad = trainer.strategy.full_tensor(name, param.grad)
                grads[name] = tensor_stats(full_grad)
                if self.save_tensors:
                    tensors[f"grad/{name}"] = full_grad.detach().cpu()
        if trainer.is_global_zero:
            _write_json(out_dir / "weights.json", {"step": step, "tensors": weights})
            _write_json(out_dir / "grads.json", {"step": step, "tensors": grads})
            if tensors:
                _save_safetensors(out_dir / "tensors.safetensors", tensors)

    def on_exception(self, trainer: Trainer, module: NanoModule, exception: BaseException) -> None:
        """Remove the forward hooks if a dump step failed half-way."""
        self._disarm()

    def teardown(self, trainer: Trainer, module: NanoModule, stage: str) -> None:
        """Remove any forward hooks still armed."""
        self._disarm()


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    # NaN/inf are valid statistics of a broken tensor; json writes them as NaN/Infinity.
    path.write_text(json.dumps(payload, indent=1), encoding="utf-8")


def _save_safetensors(path: Path, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    # safetensors refuses tensors that share storage; clone into contiguous, unshared copies.
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(path))
