"""Peer check: training tokens/s of torchtitan's Llama-3 and of nanotrain at one shape, one GPU.

    python benchmarks/peer_torchtitan.py                 # dense-1b shape, 5 warm-up + 10 timed
    python benchmarks/peer_torchtitan.py --nanotrain-compile model --trainer-policy matched,default
    python benchmarks/peer_torchtitan.py --smoke         # CPU: all rows tiny, eager, 2 + 2 steps

In one process, on one device, on the same random batch (micro-batch x sequence length tokens,
one optimizer step per micro-batch), in bf16-mixed with torch.compile, one table row each:

- **torchtitan**: `torchtitan.models.llama3.model.model.Transformer` built from
  `TransformerModelArgs` of the same shape, trained as torchtitan's own trainer trains on one
  GPU: AMP bf16 autocast over fp32 weights (torchtitan's `maybe_enable_amp` without FSDP),
  each `TransformerBlock` compiled with `fullgraph=True` (its `apply_compile`), its
  `cross_entropy_loss` compiled and divided by the batch's tokens, gradient clipping at 1.0
  (`job.training.max_norm`), fused AdamW (its defaults: lr 8e-4, betas 0.9/0.95, weight decay
  0.1).
- **nanotrain Trainer**: `nanotrain.Trainer(precision=BF16Mixed(...), gradient_clip_val=1.0)`
  fitting `LanguageModelModule(model=<the same DenseConfig>, compile_layers=True)` (each decoder
  layer compiled, as torchtitan compiles each block; `--nanotrain-compile model` compiles the
  whole model, loss included, as one graph instead) with torchtitan's AdamW settings (constant
  lr 8e-4, no warm-up), default callbacks, no checkpointing and no validation, logging only
  after the timed steps; a callback times its steps. Its precision policy puts every GEMM in
  bf16, as torchtitan's autocast does (`--trainer-policy matched,default` adds a row with
  nanotrain's default policy, which keeps the output head in fp32: DeepSeek-V3's recipe,
  docs/precision.md).
- **nanotrain bare loop** (unless `--no-bare`): the same model and compile without the
  Trainer, in the same step as torchtitan's (autocast forward and loss, backward, clipping,
  fused AdamW): what the Trainer costs on top.

Compilation takes most of the run. On an H200 (2026-11-27) the default rows took 15 s
(torchtitan), 15 s (Trainer) and 2 s (bare loop: the Trainer's compiled layer comes from the
inductor cache), the whole script 55 s; compiling nanotrain's whole model as one graph
(`--nanotrain-compile model`) took 50-70 s per nanotrain row for the same step time within 2%
(Trainer 139.8 ms against 139.3 ms per layer). A row is printed as a `peer:` line as soon as
it is measured, so a run stopped by a time limit still shows the rows it finished; the table
follows at the end.

Each system runs `--warmup` steps (compilation included), then `--steps` timed steps between
two `torch.cuda.synchronize()` calls. MFU = `nanotrain.models.accounting.flops_per_token` (6 x
matmul parameters + causal attention; the same shape, so the same FLOPs for all rows) x
tokens/s / the GPU's dense bf16 peak (`benchmarks/gpu.py`'s `peak_tflops`; `--peak-tflops`
for an unknown GPU). The last column is each row's tokens/s over torchtitan's. The shape
(default `dense-1b` of `benchmarks/gpu.py`: the TinyLlama 1.1B shape, untied embeddings on both
sides) and both models' parameter counts are printed first; they must be equal.

torchtitan version: the 0.2.x model API. torchtitan 0.3.0 is built against a torch newer than
2.11 (its `torchtitan.distributed.fsdp` imports `torch.distributed.fsdp.DataParallelMeshDims`,
which torch 2.11 lacks, and `torchtitan.models.llama3` imports that module), so
`.whl/torchtitan-0.2.2-py3-none-any.whl` is the one that travels to the GPU machine, with
`tyro` (and `docstring_parser`), which its config module imports. Only the model module is
imported, with three stubs put in `sys.modules` first so that nothing else of the training
stack loads: the package `torchtitan.models.llama3` as a bare package (its `__init__` imports
the data loaders: `datasets`, `torchdata`), `torchtitan.protocols.train_spec` as a module that
holds only `ModelProtocol` (the one name `model.py` takes from it; the real module imports the
data loader, validator and metrics: `torchdata`, `datasets`, `wandb`), and, only where triton is
absent (a CPU build of torch), `torchtitan.models.moe.kernels` (a triton kernel of the MoE
layers, which `import torchtitan` reaches and a dense model never calls).

Without CUDA it prints one line and exits 0 (`--smoke` runs all rows tiny on the CPU, eager
and in fp32 unless told otherwise); where torchtitan cannot be imported it prints why
(the ImportError) and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]


def _load_gpu_benchmark():
    """benchmarks/gpu.py, loaded by its path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("nanotrain_gpu_bench", REPO / "benchmarks/gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu = _load_gpu_benchmark()

#: the --smoke shape (the dense-100m preset shrunk; intermediate 192 is not torchtitan's
#: default rounding of 4 x hidden, so the smoke run also checks `torchtitan_args`' fallback)
SMOKE_SHAPE = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=192,
    vocab_size=256,
)
PRECISIONS = ("bf16-mixed", "32-true")
#: --trainer-policy: the precision policy of the nanotrain Trainer rows (see `trainer_precision`)
TRAINER_POLICIES = ("matched", "default")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments (errors name the flag, through argparse)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    dense = [name for name, (base, _) in gpu.PRESETS.items() if base.startswith("dense")]
    p.add_argument("--preset", choices=dense, default="dense-1b", help="a dense preset of gpu.py")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation included)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument(
        "--precision", choices=PRECISIONS, default=None, help="default bf16-mixed (smoke: 32-true)"
    )
    p.add_argument("--no-compile", action="store_true", help="run every row eager")
    p.add_argument(
        "--nanotrain-compile",
        choices=("model", "layers"),
        default="layers",
        help="nanotrain's compile: each decoder layer (default, like torchtitan's per-block "
        "compile) or the whole model as one graph",
    )
    p.add_argument(
        "--trainer-policy",
        default="matched",
        help="the nanotrain Trainer rows, comma-separated: matched (every GEMM in bf16 under "
        "autocast, as torchtitan's; default), default (nanotrain's default precision policy, "
        "which keeps the output head in fp32)",
    )
    p.add_argument("--no-bare", action="store_true", help="skip nanotrain's bare-loop row")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the GPU's peak")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU: a tiny shape, eager, fp32, 2 + 2 steps",
    )
    args = p.parse_args(argv)
    for name in ("micro_batch", "seq_len", "warmup", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    args.trainer_policy = [x.strip() for x in args.trainer_policy.split(",") if x.strip()]
    if not args.trainer_policy or set(args.trainer_policy) - set(TRAINER_POLICIES):
        p.error(f"--trainer-policy takes {', '.join(TRAINER_POLICIES)} (comma-separated)")
    if args.precision is None:
        args.precision = "32-true" if args.smoke else "bf16-mixed"
    if args.smoke:
        args.micro_batch, args.seq_len, args.warmup, args.steps = 2, 32, 2, 2
        args.no_compile, args.no_bare = True, False
    return args


def nanotrain_config(args: argparse.Namespace):
    """The nanotrain DenseConfig both systems are built to (`--preset` of benchmarks/gpu.py,
    or the tiny smoke shape)."""
    from nanotrain.models import presets

    if args.smoke:
        return presets.get("dense-100m", **SMOKE_SHAPE, max_seq_len=args.seq_len)
    return gpu.config_of(args.preset, args.seq_len)


def describe(config) -> str:
    """The shape in one line (the fields both models are built from)."""
    return (
        f"hidden {config.hidden_size}, layers {config.num_layers}, heads {config.num_heads}, "
        f"kv heads {config.num_kv_heads}, head dim {config.head_dim}, intermediate "
        f"{config.intermediate_size}, vocab {config.vocab_size}, tied embeddings "
        f"{config.tie_word_embeddings}, rope theta {config.rope_theta:g}, rms eps "
        f"{config.rms_norm_eps:g}"
    )


# -- torchtitan -------------------------------------------------------------------------------


class Torchtitan(NamedTuple):
    """What this benchmark takes from torchtitan."""

    version: str
    Transformer: type
    TransformerModelArgs: type
    cross_entropy_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _stub(name: str, **attrs: Any) -> None:
    """Put a module `name` holding `attrs` in sys.modules (unless one is already there)."""
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        module.__file__ = f"<stub of {name} by benchmarks/peer_torchtitan.py>"
        sys.modules[name] = module


def import_torchtitan() -> Torchtitan:
    """torchtitan's Llama-3 model, its args and its loss, without the rest of its training
    stack (see the module docstring for the three stubs). Raises ImportError, with the reason,
    where that fails."""
    if importlib.util.find_spec("torchtitan") is None:
        raise ImportError(
            "No module named 'torchtitan' (install .whl/torchtitan-0.2.2-py3-none-any.whl "
            "with its tyro and docstring_parser wheels, as benchmarks/gpu_session.sh does)"
        )
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        found = "unknown"
    if importlib.util.find_spec("triton") is None:

        def generate_permute_indices(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("torchtitan's MoE kernels need triton (stubbed: not installed)")

        _stub("torchtitan.models.moe.kernels", generate_permute_indices=generate_permute_indices)
    import torchtitan.models

    package = "torchtitan.models.llama3"
    if package not in sys.modules:
        bare = types.ModuleType(package)
        bare.__path__ = [str(Path(torchtitan.models.__file__).parent / "llama3")]
        sys.modules[package] = bare
    try:
        from torchtitan.protocols.model import ModelProtocol

        _stub("torchtitan.protocols.train_spec", ModelProtocol=ModelProtocol)
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer
    except ImportError as err:
        raise ImportError(
            f"torchtitan {found}: {type(err).__name__}: {err} (this benchmark uses the "
            "torchtitan 0.2.x model API, torchtitan.models.llama3.model.model.Transformer, "
            "on torch 2.11; torchtitan 0.3 needs a newer torch)"
        ) from err
    return Torchtitan(found, Transformer, TransformerModelArgs, cross_entropy_loss)


def torchtitan_args(tt: Torchtitan, config) -> Any:
    """`TransformerModelArgs` of `config`'s shape. torchtitan derives the SwiGLU width from
    `multiple_of` and `ffn_dim_multiplier` (4 x dim x 2/3, times the multiplier, rounded up to
    a multiple); its own rounding (multiple_of 256) gives dense-1b's 5632, and any other
    width is reached exactly with multiple_of = that width and a multiplier <= 1."""
    kw = dict(
        dim=config.hidden_size,
        n_layers=config.num_layers,
        n_heads=config.num_heads,
        n_kv_heads=config.num_kv_heads,
        vocab_size=config.vocab_size,
        norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_seq_len=config.max_seq_len,
        attn_type="sdpa",
        attn_mask_type="causal",
    )
    width = config.intermediate_size
    if _torchtitan_ffn_width(config.hidden_size, 256, None) == width:
        return tt.TransformerModelArgs(**kw, multiple_of=256, ffn_dim_multiplier=None)
    base = int(2 * 4 * config.hidden_size / 3)
    multiplier = width / base if base > width else None
    assert _torchtitan_ffn_width(config.hidden_size, width, multiplier) == width
    return tt.TransformerModelArgs(**kw, multiple_of=width, ffn_dim_multiplier=multiplier)


def _torchtitan_ffn_width(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """torchtitan 0.2's `FeedForward` width for `hidden_dim=4 * dim`."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def torchtitan_model(tt: Torchtitan, config, device: torch.device | str) -> torch.nn.Module:
    """torchtitan's Transformer of `config`'s shape on `device`, initialized as torchtitan
    does (built on the meta device, then `init_weights` on the target device)."""
    with torch.device("meta"):
        model = tt.Transformer(torchtitan_args(tt, config))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


# -- steps ------------------------------------------------------------------------------------


def _autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16-mixed")


def _bare_step(model, loss_of, device: torch.device, precision: str):
    """One training step as torchtitan's trainer runs it on one device: forward and loss
    under autocast, backward, clipping to norm 1.0, fused AdamW (torchtitan's defaults)."""
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=8e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=device.type == "cuda",
    )
    params = list(model.parameters())

    def step() -> torch.Tensor:
        with _autocast(device, precision):
            loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=device.type == "cuda")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timing(NamedTuple):
    """One row: seconds per timed step, the first and last step's loss, peak GiB, and the
    wall-clock seconds of the whole run (building and compiling included)."""

    seconds: float
    first_loss: float
    last_loss: float
    peak_gib: float
    wall_s: float


def time_bare(step: Callable[[], torch.Tensor], args, device: torch.device, t_start: float):
    """Run `args.warmup` untimed steps, then time `args.steps` between two synchronizes."""
    first = step()
    for _ in range(args.warmup - 1):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        last = step()
    _sync(device)
    seconds = (time.perf_counter() - t0) / args.steps
    return Timing(
        seconds, float(first), float(last), _peak_gib(device), time.perf_counter() - t_start
    )


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def run_torchtitan(tt: Torchtitan, config, tokens, args, device) -> Timing:
    """torchtitan's row (see the module docstring)."""
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model = torchtitan_model(tt, config, device)
    loss_fn = tt.cross_entropy_loss
    if not args.no_compile:  # torchtitan's apply_compile, and its compiled loss
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, torch.compile(block, fullgraph=True))
        loss_fn = torch.compile(loss_fn)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_of() -> torch.Tensor:  # torchtitan sums the loss, then divides by the tokens
        return loss_fn(model(inputs), labels) / labels.numel()

    return time_bare(_bare_step(model, loss_of, device, args.precision), args, device, t_start)


def _nanotrain_compile(model, args) -> None:
    from nanotrain.models.compile import compile_layers, compile_model

    if args.no_compile:
        return
    if args.nanotrain_compile == "layers":
        compile_layers(model)
    else:
        compile_model(model)


def run_nanotrain_bare(config, tokens, args, device) -> Timing:
    """nanotrain's model in torchtitan's step, without the Trainer."""
    from nanotrain.models import build_model

    t_start = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(config, device=device)
    _nanotrain_compile(model, args)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_of() -> torch.Tensor:
        return model(inputs, labels).total_loss

    return time_bare(_bare_step(model, loss_of, device, args.precision), args, device, t_start)


class SameBatch(torch.utils.data.Dataset):
    """The rows of one token batch, over and over (each global batch is that batch)."""

    def __init__(self, tokens: torch.Tensor, steps: int) -> None:
        self.tokens, self.steps = tokens.cpu(), steps

    def __len__(self) -> int:
        return self.steps * len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        row = self.tokens[i % len(self.tokens)]
        return {"input_ids": row[:-1], "labels": row[1:]}


def trainer_precision(precision: str, policy: str):
    """The Trainer's precision: `precision` with nanotrain's default policy ("default": under
    bf16-mixed the embedding, the output head and the norms stay in fp32, the DeepSeek-V3
    recipe), or with every GEMM low ("matched": plain bf16 autocast, as torchtitan runs)."""
    from nanotrain.precision import BF16Mixed, PrecisionPolicy

    if precision == "bf16-mixed" and policy == "matched":
        return BF16Mixed(policy=PrecisionPolicy(keep_high_precision=()))
    return precision


def run_nanotrain_trainer(config, tokens, args, device, policy: str = "matched") -> Timing:
    """`nanotrain.Trainer.fit` of `LanguageModelModule` at the same shape, timed by a callback
    from the end of the last warm-up step to the end of the last step."""
    import nanotrain as nt

    t_start = time.perf_counter()
    total = args.warmup + args.steps
    marks: dict[str, Any] = {}

    class StepTimer(nt.Callback):
        n = 0

        def on_train_step_end(self, trainer, module, outputs, microbatches, step_idx) -> None:
            self.n += 1
            if self.n == 1:
                marks["first"] = outputs.loss.detach()
            if self.n == args.warmup:
                _sync(device)
                marks["t0"] = time.perf_counter()
            elif self.n == total:
                _sync(device)
                marks["t1"] = time.perf_counter()
                marks["last"] = outputs.loss.detach()

    compile_kw = {} if args.no_compile else {f"compile_{args.nanotrain_compile}": True}
    torch.manual_seed(0)
    module = nt.LanguageModelModule(  # torchtitan's AdamW settings, constant lr
        model=config, lr=8e-4, min_lr=8e-4, warmup_steps=0, **compile_kw
    )
    with tempfile.TemporaryDirectory() as root:
        trainer = nt.Trainer(
            strategy=nt.SingleDeviceStrategy(device),
            precision=trainer_precision(args.precision, policy),
            max_steps=total,
            global_batch_size=args.micro_batch,
            micro_batch_size=args.micro_batch,
            gradient_clip_val=1.0,
            log_every_n_steps=total + 1,
            limit_val_batches=0,
            enable_checkpointing=False,
            enable_progress_bar=False,
            shuffle=False,
            seed=0,
            default_root_dir=root,
            callbacks=[StepTimer()],
        )
        trainer.fit(module, train_dataloaders=SameBatch(tokens, total))
    if "t1" not in marks:
        raise RuntimeError(f"the Trainer stopped before step {total}")
    seconds = (marks["t1"] - marks["t0"]) / args.steps
    return Timing(
        seconds,
        float(marks["first"]),
        float(marks["last"]),
        _peak_gib(device),
        time.perf_counter() - t_start,
    )


def _free(device: torch.device) -> None:
    """What one row leaves behind, before the next: compiled graphs, cached memory."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def param_counts(tt: Torchtitan, config) -> tuple[int, int]:
    """(torchtitan's, nanotrain's) parameter count at `config`'s shape, built on meta."""
    from nanotrain.models import build_model

    with torch.device("meta"):
        theirs = tt.Transformer(torchtitan_args(tt, config))
    ours = build_model(config, device="meta")
    return (
        sum(p.numel() for p in theirs.parameters()),
        sum(p.numel() for p in ours.parameters()),
    )


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print(
            "peer: no CUDA device: nothing timed (skipped); --smoke runs the rows tiny on the CPU"
        )
        return 0
    try:
        tt = import_torchtitan()
    except ImportError as err:
        print(f"peer: torchtitan cannot be imported, nothing timed (skipped): {err}")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = nanotrain_config(args)
    theirs, ours = param_counts(tt, config)
    name = "smoke" if args.smoke else args.preset
    print(f"peer shape ({name}): {describe(config)}; batch {args.micro_batch}x{args.seq_len}")
    verdict = "equal" if theirs == ours else f"DIFFER by {ours - theirs:+,}"
    print(f"peer params: torchtitan {theirs:,}, nanotrain {ours:,} ({verdict})")
    compiled = "off" if args.no_compile else "on"
    print(
        f"peer: torch {torch.__version__}, torchtitan {tt.version}, {args.precision}, "
        f"compile {compiled}, {args.warmup} warm-up + {args.steps} timed steps, "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
        f"{time.strftime('%F')}"
    )
    peak = None
    if device.type == "cuda":
        try:
            peak = gpu.peak_tflops(argparse.Namespace(peak_tflops=args.peak_tflops))
        except ValueError as err:
            print(f"peer: MFU not shown: {err}")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, config.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator
    ).to(device)
    nano_compile = "off" if args.no_compile else f"whole {args.nanotrain_compile}"
    if not args.no_compile and args.nanotrain_compile == "layers":
        nano_compile = "per layer"
    runs: list[tuple[str, str, Callable[[], Timing]]] = [
        (
            "torchtitan",
            "off" if args.no_compile else "per block + loss",
            lambda: run_torchtitan(tt, config, tokens, args, device),
        ),
    ]
    for policy in args.trainer_policy:
        runs.append(
            (
                "nanotrain Trainer"
                + (", default policy (head fp32)" if policy == "default" else ""),
                nano_compile,
                lambda policy=policy: run_nanotrain_trainer(config, tokens, args, device, policy),
            )
        )
    if not args.no_bare:
        runs.append(
            (
                "nanotrain bare loop",
                nano_compile,
                lambda: run_nanotrain_bare(config, tokens, args, device),
            )
        )
    flops = gpu.flops_per_token(config, args.seq_len)
    rows, failed = [], 0
    for system, how, run in runs:
        try:
            rows.append((system, how, run()))
            t = rows[-1][2]
            print(
                f"peer: {system} measured: {t.seconds * 1e3:.1f} ms/step, "
                f"{args.micro_batch * args.seq_len / t.seconds:,.0f} tokens/s "
                f"({t.wall_s:.0f} s in all, compilation included)",
                flush=True,
            )
        except Exception as err:  # a failed row must not hide the others
            failed += 1
            print(f"peer: {system} FAILED: {type(err).__name__}: {err}", flush=True)
            rows.append((system, how, None))
        _free(device)
    base = rows[0][2].seconds if rows[0][2] is not None else None
    tokens_per_step = args.micro_batch * args.seq_len
    print(
        "\n| system | compile | params | batch | ms/step | tokens/s | MFU | peak GiB "
        "| loss first → last | wall s | tokens/s vs torchtitan |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for system, how, t in rows:
        count = theirs if system == "torchtitan" else ours
        if t is None:
            print(f"| {system} | {how} | {count / 1e6:,.1f}M | FAILED |  |  |  |  |  |  |  |")
            continue
        tps = tokens_per_step / t.seconds
        mfu = f"{100 * flops * tps / (peak * 1e12):.1f}%" if peak else "-"
        ratio = f"{base / t.seconds:.3f}" if base else "-"
        print(
            f"| {system} | {how} | {count / 1e6:,.1f}M | {args.micro_batch}x{args.seq_len} "
            f"| {t.seconds * 1e3:.1f} | {tps:,.0f} | {mfu} | {t.peak_gib:.1f} "
            f"| {t.first_loss:.3f} → {t.last_loss:.3f} | {t.wall_s:.0f} | {ratio} |"
        )
    return 1 if failed or theirs != ours else 0


if __name__ == "__main__":
    sys.exit(main())
