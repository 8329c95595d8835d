"""Expert parallelism: token dispatch/combine cost by ep size, and load balance over training.

Run (about a minute on 2 CPU cores):

    python benchmarks/expert.py

(a) Dispatch + combine. On a forked gloo world of P = 1, 2, 4 ranks (CPU, one thread each)
every rank routes N tokens of width H to K of E experts uniformly at random and runs
`nanotrain.parallel.expert.run_experts_parallel` with identity experts, forward and backward
(so the time is that of sorting, the count exchange, the two all-to-alls, the regrouping and
their reverses). The bytes a rank sends per forward are measured from the split sizes
(copies whose expert lives on the same rank do not cross the network) and printed next to
the formula for uniform routing:

    bytes per rank per forward = 2 directions x N K H elem x (P - 1) / P

The backward sends the same amount again. Four ranks on two cores share the cores, so the
P=4 times include waiting for a core; the bytes are exact.

(b) Load balance. The tiny DeepSeek preset trains on bytes of real text (the Python standard
library's source, vocabulary 257) for a few dozen steps, once with the aux-loss-free bias
update (DeepSeek-V3's gamma, and a faster one) and once without (bias_update_speed=0). The
table shows the max/mean expert load (1.0 = perfectly balanced), averaged over the MoE
layers, early and late in the run.

(c) Expert scaling. One `GroupedExperts` layer, fwd+bwd on 4,096 token copies (H=128, expert
width 64, so the FLOPs are the same at every size) with 8, 32 and 128 local experts, equal
groups (balanced routing), one thread, fp32. Three computations at every size, every one of
them in every round (median of --rounds): the first per-expert loop that indexed the stacks
(`w[e]`, quadratic in E), the per-expert loop over `unbind` views (`looped_swiglu`, linear in
E, still what unequal groups run) and the layer itself (`GroupedExperts.forward`: for equal groups the batched GEMMs of
`batched_swiglu`, a constant number of ops). Backward starts from a fixed dense gradient.
Then the layer's time at E over its own time at the smallest E, and over the fastest of the
loop and the layer at the smallest E. The last column is a floor for that ratio set by memory
traffic alone: at fixed FLOPs only the weights grow with E, and one step streams them three
times (read forward, read again for the input gradient, write their gradient), so it cannot
run faster than the smallest E's time plus the extra bytes over this machine's measured
copy bandwidth (one thread, a 256 MiB copy).

(d) Unequal groups. As (c), with the 4,096 rows routed by skewed probabilities (groups of
different sizes, some empty, as dropless routing leaves them): the unbind loop against the
layer, which runs such groups as grouped GEMMs (`grouped_swiglu`) where the installed torch
has them on the CPU, else the same loop. `--only-scaling` runs just (c) and (d) (seconds);
`--cold` writes 64 MiB before every step of (c), so each step starts with its weights out of
cache, as a layer of a deep model does (the other layers run in between).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import nanotrain.parallel.expert as expert
from nanotrain.models import build_model, presets
from nanotrain.models.expert_compute import looped_swiglu
from nanotrain.models.moe import GroupedExperts, combine, copy_weights, dispatch
from nanotrain.parallel import ParallelMesh

N, H, E, K = 4096, 256, 8, 2  # tokens per rank, hidden, experts, top-k
ELEM = 4  # fp32


def _uniform_routing(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K distinct experts per token, uniformly at random, with random gate weights."""
    idx = torch.rand(n, E, generator=generator).argsort(dim=1)[:, :K]
    return idx, torch.rand(n, K, generator=generator)


def _dispatch_combine(rank: int, world: int, iters: int) -> dict[str, float]:
    """Median fwd+bwd time and bytes sent per forward on this rank."""
    mesh = ParallelMesh.build(ep=world)
    g = torch.Generator().manual_seed(rank)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    sent: list[int] = []
    exchange = expert.exchange_splits

    def recording(counts: torch.Tensor, group: Any) -> expert.ExpertSplits:
        splits = exchange(counts, group)
        remote_in = sum(splits.input_splits) - splits.input_splits[mesh.ep_rank]
        remote_out = sum(splits.output_splits) - splits.output_splits[mesh.ep_rank]
        sent.append((remote_in + remote_out) * H * ELEM)  # dispatch + combine
        return splits

    expert.exchange_splits = recording  # count the bytes of every dispatch
    times = []
    try:
        for i in range(iters + 2):
            idx, weight = _uniform_routing(N, g)
            if world > 1:
                dist.barrier(group=mesh.ep_group)
            start = time.perf_counter()
            d = dispatch(h, idx, E)
            y_sorted = expert.run_experts_parallel(
                d.x, d.counts, lambda x, c, s: x * s[:, None], mesh.ep_group,
                scale=copy_weights(weight, d),
            )  # fmt: skip
            combine(y_sorted, d, N).sum().backward()
            if i >= 2:  # the first two warm up the allocator and the gloo pairs
                times.append(time.perf_counter() - start)
    finally:
        expert.exchange_splits = exchange
    return {"seconds": statistics.median(times), "bytes": statistics.mean(sent or [0])}


def _rank_main(rank: int, world: int, port: int, iters: int, conn: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    result = _dispatch_combine(rank, world, iters)
    conn.send(result)
    conn.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, iters: int) -> list[dict[str, float]]:
    """Results of `_dispatch_combine` on every rank of a forked world of `world` ranks."""
    if world == 1:
        torch.set_num_threads(1)
        return [_dispatch_combine(0, 1, iters)]
    ctx = mp.get_context("fork")
    port = _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, iters, pipes[r][1]))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [reader.recv() for reader, _ in pipes]
    for p in procs:
        p.join()
    return results


def dispatch_table(iters: int) -> None:
    print(f"(a) dispatch + combine, N={N} tokens/rank, H={H}, E={E}, K={K}, fp32, gloo on CPU")
    print("| ep | fwd+bwd ms (median, slowest rank) | MiB sent/rank/fwd | formula MiB |")
    print("|---|---|---|---|")
    for world in (1, 2, 4):
        results = run_world(world, iters)
        ms = max(r["seconds"] for r in results) * 1e3
        sent = statistics.mean(r["bytes"] for r in results) / 2**20
        formula = 2 * N * K * H * ELEM * (world - 1) / world / 2**20
        print(f"| {world} | {ms:.1f} | {sent:.2f} | {formula:.2f} |")


def _text_batches(steps: int, batch: int, seq: int) -> torch.Tensor:
    """[steps, batch, seq + 1] byte tokens of real text (the stdlib's own source)."""
    from nanotrain.data.demo import demo_corpus_files

    need = steps * batch * (seq + 1)
    data = b""
    for path in demo_corpus_files(max_bytes=max(need, 200_000)):
        data += path.read_bytes()
        if len(data) >= need:
            break
    tokens = torch.frombuffer(bytearray(data[:need]), dtype=torch.uint8).long()
    return tokens.view(steps, batch, seq + 1)


def imbalance_run(speed: float, steps: int, batch: int = 8, seq: int = 64) -> dict[str, float]:
    """Train tiny DeepSeek for `steps` steps; mean max/mean load early, late and the loss."""
    torch.manual_seed(0)
    config = presets.get("tiny", vocab_size=257, bias_update_speed=speed)
    model = build_model(config, generator=torch.Generator().manual_seed(0)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    ratios, losses = [], []
    for tokens in _text_batches(steps, batch, seq):
        out = model(tokens[:, :-1], labels=tokens[:, 1:])
        out.total_loss.backward()
        stats = model.balance_experts()  # before the step, as LanguageModelModule does
        opt.step()
        opt.zero_grad()
        ratios.append(float((stats.loads.max(-1).values / stats.loads.mean(-1)).mean()))
        losses.append(float(out.loss.detach()))
    tail = max(1, steps // 3)
    return {
        "first": statistics.mean(ratios[:10]),
        "last": statistics.mean(ratios[-tail:]),
        "loss": statistics.mean(losses[-tail:]),
        "tail": tail,
    }


def imbalance_table(steps: int) -> None:
    torch.set_num_threads(1)
    print(f"\n(b) max/mean expert load, tiny DeepSeek (8 experts, top-2), {steps} steps of 8x64")
    print("| bias update | steps 1-10 | last third | lm loss, last third |")
    print("|---|---|---|---|")
    for speed in (0.0, 0.001, 0.01):
        r = imbalance_run(speed, steps)
        name = "off (gamma=0)" if speed == 0 else f"on, gamma={speed}"
        print(f"| {name} | {r['first']:.3f} | {r['last']:.3f} | {r['loss']:.3f} |")


def _indexed_swiglu(x: torch.Tensor, sizes: list[int], ex: GroupedExperts) -> torch.Tensor:
    """The former expert loop (indexes the stacks per expert), kept to compare against."""
    out = []
    for e, x_e in enumerate(x.split(sizes)):
        a = torch.nn.functional.silu(x_e @ ex.gate_proj[e].T) * (x_e @ ex.up_proj[e].T)
        out.append(a @ ex.down_proj[e].T)
    return torch.cat(out)


def _expert_forward(
    name: str, x: torch.Tensor, sizes: list[int], ex: GroupedExperts
) -> torch.Tensor:
    """One of the three computations table (c) compares: "indexed", "loop" or "now"."""
    if name == "indexed":
        return _indexed_swiglu(x, sizes, ex)
    if name == "loop":
        return looped_swiglu(x, sizes, ex.gate_proj, ex.up_proj, ex.down_proj)
    return ex(x, sizes)


def copy_bandwidth(mib: int = 256, rounds: int = 5) -> float:
    """Bytes per second one thread moves in a large tensor copy (bytes read + written)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(rounds))
    return 2 * src.numel() * 4 / best


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_ms(
    layers: dict[int, tuple[GroupedExperts, torch.Tensor, list[int]]],
    paths: tuple[str, ...],
    grad_out: torch.Tensor,
    rounds: int,
    cold: bool = False,
) -> dict[tuple[int, str], float]:
    """Median fwd+bwd ms of every (experts, path); every one runs in every round, so a slow
    spell of the box hits all of them alike and their ratios compare times taken side by side.
    `cold`: write 64 MiB (twice a usual last-level cache) before each step, untimed, so the
    layer finds its weights in memory, as a layer of a deep model does."""
    times: dict[tuple[int, str], list[float]] = {(e, k): [] for e in layers for k in paths}
    evict = torch.zeros(16 * 2**20) if cold else None
    for _ in range(rounds):
        for e, (ex, x, sizes) in layers.items():
            for name in paths:
                if evict is not None:
                    evict.add_(1.0)
                t0 = time.perf_counter()
                _expert_forward(name, x, sizes, ex).backward(grad_out)
                times[e, name].append(time.perf_counter() - t0)
                ex.zero_grad(set_to_none=True)
                x.grad = None
    return {key: 1e3 * statistics.median(v) for key, v in times.items()}


def _expert_layers(
    experts: tuple[int, ...], n: int, h: int, inter: int, dropless: bool
) -> dict[int, tuple[GroupedExperts, torch.Tensor, list[int]]]:
    """A layer, its input rows and their group sizes per number of experts: n // e rows each,
    or (dropless) n rows drawn by skewed routing probabilities, so groups differ and some
    are empty, as dropless routing leaves them."""
    layers = {}
    g = torch.Generator().manual_seed(2)
    for e in experts:
        ex = GroupedExperts(e, h, inter)
        for p in ex.parameters():
            torch.nn.init.normal_(p, std=0.02)
        if dropless:
            probs = torch.rand(e, generator=g) ** 3
            drawn = torch.multinomial(probs, n, replacement=True, generator=g)
            sizes = torch.bincount(drawn, minlength=e).tolist()
        else:
            sizes = [n // e] * e
        layers[e] = (ex, torch.randn(n, h, requires_grad=True), sizes)
    return layers


def dropless_table(rounds: int, experts: tuple[int, ...] = (8, 32, 128)) -> None:
    """(d) as (c), with unequal groups: the unbind loop against the layer's grouped GEMMs."""
    n, h, inter = 4096, 128, 64
    print(f"\n(d) unequal groups (dropless routing), {n} token copies, H={h}, width {inter}, fp32")
    print("| local experts | empty experts | largest group | unbind loop ms "
          "| GroupedExperts ms | loop / layer | layer / layer at smallest E |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    torch.set_num_threads(1)
    layers = _expert_layers(experts, n, h, inter, dropless=True)
    grad_out = torch.randn(n, h, generator=torch.Generator().manual_seed(1))
    ms = _median_ms(layers, ("loop", "now"), grad_out, rounds)
    for e, (_, _, sizes) in layers.items():
        print(
            f"| {e} | {sizes.count(0)} | {max(sizes)} | {ms[e, 'loop']:.1f} | {ms[e, 'now']:.1f} "
            f"| {ms[e, 'loop'] / ms[e, 'now']:.2f}x | {ms[e, 'now'] / ms[experts[0], 'now']:.2f}x |"
        )


def scaling_table(rounds: int, experts: tuple[int, ...] = (8, 32, 128), cold: bool = False) -> None:
    """(c) fwd+bwd of one expert layer at fixed tokens and FLOPs, by number of local experts."""
    n, h, inter = 4096, 128, 64
    caches = ", caches evicted before every step" if cold else ""
    print(
        f"\n(c) one expert layer fwd+bwd, {n} token copies, H={h}, expert width {inter}, fp32{caches}"
    )
    print(
        "| local experts | indexed per expert (first) ms | unbind loop (before) ms "
        "| GroupedExperts (now: batched) ms | now / now at smallest E "
        "| now / fastest at smallest E | memory-traffic floor of that ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    torch.set_num_threads(1)
    bandwidth = copy_bandwidth()
    weight_bytes = {e: 3 * e * h * inter * 4 for e in experts}  # gate, up, down stacks
    # a dense upstream gradient, as a layer inside a model gets (y.sum() would hand backward
    # an expanded stride-0 tensor, which no real loss produces)
    grad_out = torch.randn(n, h, generator=torch.Generator().manual_seed(1))
    layers = _expert_layers(experts, n, h, inter, dropless=False)
    ms = _median_ms(layers, ("indexed", "loop", "now"), grad_out, rounds, cold)
    base = ms[experts[0], "now"]
    best = min(ms[experts[0], "loop"], base)
    for e in experts:
        extra_ms = 1e3 * 3 * (weight_bytes[e] - weight_bytes[experts[0]]) / bandwidth
        print(
            f"| {e} | {ms[e, 'indexed']:.1f} | {ms[e, 'loop']:.1f} | {ms[e, 'now']:.1f} "
            f"| {ms[e, 'now'] / base:.2f}x | {ms[e, 'now'] / best:.2f}x "
            f"| {(best + extra_ms) / best:.2f}x |"
        )
    print(f"copy bandwidth, one thread: {bandwidth / 1e9:.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=10, help="timed dispatches per ep size")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run in (b)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per size in (c)")
    parser.add_argument("--only-scaling", action="store_true", help="run only tables (c) and (d)")
    parser.add_argument(
        "--cold", action="store_true", help="(c): evict the caches before every timed step"
    )
    args = parser.parse_args()
    scaling_table(args.rounds, cold=args.cold)
    dropless_table(args.rounds)
    if args.only_scaling:
        return
    dispatch_table(args.iters)
    imbalance_table(args.steps)


if __name__ == "__main__":
    main()
