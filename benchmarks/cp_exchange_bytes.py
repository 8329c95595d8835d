"""Context parallelism: bytes one rank exchanges per attention layer, MLA's latent vs dense K/V.

Run (about a minute on 2 CPU cores):

    python benchmarks/cp_exchange_bytes.py [--seq-len 256] [--cp 2 4]

On a forked gloo world of cp ranks (CPU, one thread each), every rank builds ONE attention
layer of the real code (`MLAttention` of `deepseek-v3-671b`, `DenseAttention` of `dense-8b`)
with the mesh's context-parallel group, feeds it its two chunks of one sequence of
``--seq-len`` tokens (batch 1, fp32) and runs forward and backward under a
`nanotrain.planning.comm_meter.CommMeter`. The meter's bytes on the cp group (ring model:
``(cp - 1) / cp`` of the gathered tensor per rank, what a rank sends and receives) are split
into the forward all-gather and the backward reduce-scatter and printed next to the formula
``(cp - 1) * seq_len / cp * width * element_bytes`` (width: kv_lora_rank + qk_rope_head_dim
for MLA, 2 * num_kv_heads * head_dim for dense) and, where present, the planner's
`nanotrain.planning.context_parallel.cp_layer_exchange_bytes`.

MLA's layer is built with 2 heads instead of 128 to fit the CPU: the latent and rope key it
gathers do not depend on the heads (each rank expands them to its heads locally). The last
table row prices what MLA would move if it gathered its per-head K and V instead
(128 x (192 + 128) elements per token): the saving of gathering the latent.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanotrain.models import presets
from nanotrain.models.attention import DenseAttention, MLAttention
from nanotrain.models.config import DeepSeekConfig
from nanotrain.models.layers import rope_cos_sin
from nanotrain.parallel import ParallelMesh
from nanotrain.parallel.context import causal_mask, chunk_positions
from nanotrain.planning.comm_meter import CommMeter

ELEM = 4  # fp32
MODELS = {"mla": "deepseek-v3-671b", "dense": "dense-8b"}


def layer_config(kind: str) -> Any:
    """The preset's config; MLA with 2 heads (its exchange does not depend on them)."""
    config = presets.get(MODELS[kind])
    if kind == "mla":
        config = dataclasses.replace(config, num_heads=2)
    return config


def exchange_width(config: Any) -> int:
    """Elements per token the layer all-gathers: MLA's c_KV + k^R, else K and V."""
    if isinstance(config, DeepSeekConfig):
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_kv_heads * config.head_dim


def measure(kind: str, seq_len: int) -> dict[str, float]:
    """Forward and backward wire bytes of one layer on this rank's cp group."""
    config = layer_config(kind)
    mesh = ParallelMesh.build(cp=dist.get_world_size())
    torch.manual_seed(0)
    cls = MLAttention if kind == "mla" else DenseAttention
    layer = cls(config, cp_group=mesh.cp_group)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    cp = mesh.cp_size
    positions = chunk_positions(seq_len, cp, mesh.cp_rank)
    rope_dim = config.qk_rope_head_dim if kind == "mla" else config.head_dim
    cos, sin = rope_cos_sin(seq_len, rope_dim, config.rope_theta, config.rope_scaling, "cpu")
    x = torch.randn(1, seq_len // cp, config.hidden_size, requires_grad=True)
    meter = CommMeter({"cp": mesh.cp_group})
    with meter:
        y = layer(x, cos[positions], sin[positions], causal_mask(positions, seq_len))
        forward = meter.bytes["cp"]
        y.square().mean().backward()
    backward = meter.bytes["cp"] - forward
    ops = sorted({e.op for e in meter.events})
    return {"forward": forward, "backward": backward, "ops": ops}


def _rank_main(rank: int, world: int, port: int, args: Any, conn: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    conn.send({kind: measure(kind, args.seq_len) for kind in MODELS})
    conn.close()
    dist.destroy_process_group()


def run_world(world: int, args: Any) -> list[dict[str, Any]]:
    """`measure` of both layers on every rank of a forked world of `world` ranks."""
    ctx = mp.get_context("fork")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, args, pipes[r][1]))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [reader.recv() for reader, _ in pipes]
    for p in procs:
        p.join()
    return results


def planner_bytes(kind: str, seq_len: int, cp: int) -> str:
    """The planner's (forward, backward) bytes as text, or "n/a" where it is not installed."""
    try:
        from nanotrain.planning.context_parallel import cp_layer_exchange_bytes
    except ImportError:
        return "n/a"
    fwd, bwd = cp_layer_exchange_bytes(presets.get(MODELS[kind]), seq_len, cp, ELEM)
    return f"{fwd / 2**10:.0f} / {bwd / 2**10:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    t = args.seq_len
    print(f"one attention layer, one sequence of {t} tokens, fp32, KiB per rank")
    print("| cp | layer | elements/token | measured fwd / bwd | formula | planner |")
    print("|---|---|---|---|---|---|")
    for cp in args.cp:
        results = run_world(cp, args)
        measured = {}
        for kind in MODELS:
            fwd = max(r[kind]["forward"] for r in results)
            bwd = max(r[kind]["backward"] for r in results)
            measured[kind] = fwd
            width = exchange_width(layer_config(kind))
            formula = (cp - 1) * (t // cp) * width * ELEM
            print(
                f"| {cp} | {MODELS[kind]} ({'latent' if kind == 'mla' else 'K/V'}) | {width} "
                f"| {fwd / 2**10:.0f} / {bwd / 2**10:.0f} | {formula / 2**10:.0f} "
                f"| {planner_bytes(kind, t, cp)} |"
            )
        v3 = presets.get(MODELS["mla"])
        per_head = v3.num_heads * (v3.qk_nope_head_dim + v3.qk_rope_head_dim + v3.v_head_dim)
        expanded = (cp - 1) * (t // cp) * per_head * ELEM
        print(
            f"| {cp} | {MODELS['mla']} (per-head K/V if gathered) | {per_head} "
            f"| - | {expanded / 2**10:.0f} | - |"
        )
        print(
            f"|   | ratio dense K/V / MLA latent (measured) | "
            f"| {measured['dense'] / measured['mla']:.2f}x | | |"
        )


if __name__ == "__main__":
    main()
