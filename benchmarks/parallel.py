"""MegatronStrategy layouts side by side: step time, per-rank memory, communication per group.

A dense model (the `tiny-dense` preset, widened) is trained for a few steps under each layout
on a forked gloo world (CPU). For every layout the table shows the median step time, the
per-rank bytes of parameters, gradients (the persistent buffer: ZeRO-2 keeps only its shard
between steps) and optimizer state, and the bytes rank 0 sends per step on the tp, dp and pp
groups, measured by counting every collective (`nanotrain.planning.comm_meter.CommMeter`),
next to the planner's prediction (`nanotrain.planning.communication.comm_estimate`, which
also counts the small reductions: cross-entropy, grad norm, loss sums) and the textbook value:

* tp (Megatron-LM, Shoeybi et al. 2019): 4 all-reduces of the ``[b, s, h]`` activations per
  layer and microbatch (2 forward, 2 backward); with sequence parallelism (Korthikanti et al.
  2022) each all-reduce becomes an all-gather plus a reduce-scatter: the same bytes;
* dp: one all-reduce of the local gradient (DDP); ZeRO-2 = reduce-scatter of the gradient +
  all-gather of the parameters, the same bytes as DDP; ZeRO-1 here all-reduces the gradient
  (every rank keeps it whole) and then all-gathers parameters, 1.5x DDP.

Bytes on the wire per rank assume ring algorithms on a group of g ranks: all-reduce of N bytes
sends 2(g-1)/g N, all-gather and reduce-scatter of N bytes (the full tensor) send (g-1)/g N,
a pipeline send N.
Run (about a minute on 2 CPU cores):

    python benchmarks/parallel.py --world 4 --steps 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import nanotrain as nt
from nanotrain.planning import PlanLayout, Workload
from nanotrain.planning.comm_meter import CommMeter
from nanotrain.planning.communication import comm_estimate
from nanotrain.strategies.megatron import MegatronStrategy

LAYOUTS: list[dict[str, Any]] = [
    dict(tp=1),
    dict(tp=1, zero_stage=1),
    dict(tp=1, zero_stage=2),
    dict(tp=2),
    dict(tp=2, zero_stage=2),
    dict(tp=2, sequence_parallel=True),
    dict(tp=4),
    dict(tp=1, pp=2),
    dict(tp=1, pp=2, virtual_pp=2),
]
MODEL = dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=4)
VOCAB, SEQ, MICRO, GLOBAL = 1024, 128, 2, 8


class Tokens(Dataset):
    """Random token sequences {"input_ids", "labels"} of length `SEQ`."""

    def __init__(self, n: int = 256) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class StepProbe(nt.Callback):
    """Times steps and switches the counter on for every step after the first (warm-up)."""

    def __init__(self, counter: CommMeter) -> None:
        self.counter, self.times, self.t0 = counter, [], 0.0
        self.grad_bytes = 0

    def on_train_end(self, trainer, module) -> None:
        self.grad_bytes = trainer.strategy.grad_buffer_bytes()

    def on_train_step_start(self, trainer, module, batch, batch_idx) -> None:
        self.counter.counting = trainer.global_step >= 1
        self.t0 = time.perf_counter()

    def on_train_step_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= 2:
            self.times.append(time.perf_counter() - self.t0)
        self.counter.counting = False


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_layout(layout: dict[str, Any], steps: int, root: str) -> dict[str, Any]:
    """Train `steps` steps under `layout` on this rank; return timings, bytes, comm."""
    strategy = MegatronStrategy(**layout)
    strategy.setup_environment()
    mesh = strategy.mesh
    counter = CommMeter.for_strategy(strategy)
    counter.counting = False
    probe = StepProbe(counter)
    module = nt.LanguageModelModule("tiny-dense", model_overrides=MODEL, vocab_size=VOCAB)
    trainer = nt.Trainer(
        strategy=strategy, max_steps=steps, global_batch_size=GLOBAL, micro_batch_size=MICRO,
        callbacks=[probe], default_root_dir=root, loggers=[], seed=0,
    )  # fmt: skip
    with counter:
        trainer.fit(module, train_dataloaders=Tokens())
    counted_steps = steps - 1
    plan_layout = PlanLayout.from_strategy(strategy, mesh.world_size)
    plan = comm_estimate(
        module.config, plan_layout, Workload(SEQ, MICRO, GLOBAL, "32-true"), mesh.pp_rank
    )
    return {
        "planned": {g: plan.on_group(g) for g in ("tp", "pp", "dp")},
        "step_s": statistics.median(probe.times),
        "param_bytes": _tensor_bytes(module.parameters()),
        "grad_bytes": probe.grad_bytes,
        "optim_bytes": strategy.optimizer_state_bytes(),
        "comm": {k: v / counted_steps for k, v in counter.bytes.items()},
        "local_params": sum(p.numel() for p in module.parameters()),
        "dp": mesh.dp_size,
        "tp": mesh.tp_size,
        "pp": mesh.pp_size,
    }


def textbook(result: dict[str, Any], layout: dict[str, Any]) -> dict[str, float]:
    """Expected wire bytes per rank and step on tp and dp (see the module docstring)."""
    tp, dp, el = result["tp"], result["dp"], 4
    num_micro = GLOBAL // (MICRO * dp)
    activation = MICRO * SEQ * MODEL["hidden_size"] * el
    out = {"tp": 4 * MODEL["num_layers"] * num_micro * 2 * (tp - 1) / tp * activation}
    grad = result["local_params"] * el
    ring = (dp - 1) / dp
    out["dp"] = {0: 2 * ring * grad, 1: 3 * ring * grad, 2: 2 * ring * grad}[
        layout.get("zero_stage", 0)
    ]
    return out


def _rank_main(rank: int, world: int, port: int, steps: int, conn: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as root:
        for i, layout in enumerate(LAYOUTS):
            if world % (layout["tp"] * layout.get("pp", 1)):
                continue
            results.append((layout, run_layout(layout, steps, f"{root}/{i}")))
    if rank == 0:
        conn.send(results)
    conn.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, args.world, port, args.steps, writer))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = reader.recv()
    for p in procs:
        p.join()
    print(f"world={args.world}, dense model {MODEL}, vocab {VOCAB}, seq {SEQ}, micro {MICRO}, "
          f"global batch {GLOBAL}, fp32, gloo on CPU; bytes are per rank, MiB")  # fmt: skip
    header = (
        "| layout | step s | params | grads | optimizer | tp sent/step (planned; textbook) "
        "| dp sent/step (planned; textbook) | pp sent/step (planned) |"
    )
    print(header)
    print("|" + "---|" * 8)
    for layout, r in results:
        book, plan = textbook(r, layout), r["planned"]
        name = f"tp={r['tp']} dp={r['dp']} zero={layout.get('zero_stage', 0)}"
        name += f" pp={r['pp']}" if r["pp"] > 1 else ""
        name += f"x{layout['virtual_pp']}" if layout.get("virtual_pp", 1) > 1 else ""
        name += " sp" if layout.get("sequence_parallel") else ""
        sent = {g: r["comm"].get(g, 0.0) for g in ("tp", "dp", "pp")}
        print(
            f"| {name} | {r['step_s']:.3f} | {_mib(r['param_bytes'])} | {_mib(r['grad_bytes'])} "
            f"| {_mib(r['optim_bytes'])} | {_mib(sent['tp'])} ({_mib(plan['tp'])}; "
            f"{_mib(book['tp'])}) | {_mib(sent['dp'])} ({_mib(plan['dp'])}; {_mib(book['dp'])}) "
            f"| {_mib(sent['pp'])} ({_mib(plan['pp'])}) |"
        )


if __name__ == "__main__":
    main()
