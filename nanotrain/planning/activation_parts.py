"""What the per-layer activation formulas (`nanotrain.planning.activation_layers`) count in:
the bytes per element a precision saves (`Dtypes`), one microbatch's dimensions on one rank
(`Dims`), bytes per part (`Ledger`), and the two pieces every block shares (an RMSNorm, the
inputs its GEMMs save).

Dtypes (`Dtypes`): "32-true" saves fp32 everywhere; "bf16-true" saves bf16 activations but
RMSNorm keeps an fp32 copy of its input (it computes in fp32); the autocast-style modes
("bf16-mixed", "16-mixed", the fp8/fp4 emulations and, approximated alike, "transformer-engine")
keep an fp32 residual stream and fp32 norm outputs, and every low-precision GEMM saves its OWN
low-precision copy of its input and of its weight, which we count under "weight_copies". Under
plain autocast ("bf16-mixed", "16-mixed") the weight casts are made once per training step and
shared by its microbatches (`nanotrain.models.cast_cache`; `Dtypes.copies_per_step`); the
emulations quantize their weights per call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["F32", "I64", "Dims", "Dtypes", "Ledger", "dtypes_for", "gemm_inputs", "norm"]

I64, F32 = 8, 4  # bytes per int64 / fp32 element


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what a precision mode saves.

    stream: the residual stream and embedding output; gemm: GEMM outputs and what is computed
    from them inside a block; param: parameters; cast_copies: each low-precision GEMM saves its
    own low-precision copy of its input (when that input is wider) and of its weight;
    copies_per_step: the weight copies are made once per step, not per microbatch;
    fp8_experts: the routed experts keep their rows and SwiGLU inputs (gate and up outputs)
    as e4m3 with one fp32 scale per 1 x 128 tile (`nanotrain.models.fp8_saves`).
    """

    stream: int
    gemm: int
    param: int
    cast_copies: bool
    copies_per_step: bool = False
    fp8_experts: bool = False

    @property
    def norm_out(self) -> int:
        """RMSNorm output: weight (param dtype) times the normalized input cast back."""
        return max(self.param, self.stream)

    def with_stream(self, stream: int) -> Dtypes:
        """The same dtypes with a residual stream of `stream` bytes per element."""
        return replace(self, stream=stream)


def dtypes_for(precision: str, fp8_experts: bool = False) -> Dtypes:
    """The `Dtypes` a Trainer precision name saves (see the module docstring), with the
    routed experts' saves in fp8 when `fp8_experts`."""
    if precision == "32-true":
        return Dtypes(4, 4, 4, False, fp8_experts=fp8_experts)
    if precision == "bf16-true":
        return Dtypes(2, 2, 2, False, fp8_experts=fp8_experts)
    # autocast (bf16/fp16), whose weight casts last the step, and the emulations built on it
    return Dtypes(4, 2, 4, True, precision in ("bf16-mixed", "16-mixed"), fp8_experts)


@dataclass(frozen=True)
class Dims:
    """One microbatch on one rank: b sequences of s tokens, tp ranks, sequence parallel or not,
    and which SDPA kernel runs ("fused": flash / memory-efficient; "math": CPU fallback)."""

    b: int
    s: int
    tp: int
    sp: bool
    kernel_for_unequal_dims: str  # "fused" (cuda) or "math" (CPU, qk head dim != v head dim)
    # under sequence parallelism the gathered block inputs are saved as this rank's shards
    # (`nanotrain.parallel.sp_regather`); not inside a recomputed block
    shards: bool = True

    @property
    def saves_shards(self) -> bool:
        """Whether a gathered block input is saved as this rank's shard."""
        return self.sp and self.shards

    def recomputed(self) -> Dims:
        """The same microbatch inside a recomputed block (gathered inputs saved whole)."""
        return replace(self, shards=False)

    @property
    def n(self) -> int:
        """Tokens of the whole microbatch (what the tp region sees)."""
        return self.b * self.s

    @property
    def t(self) -> int:
        """Tokens of the residual stream on this rank."""
        return self.n // self.tp if self.sp and self.tp > 1 else self.n


class Ledger(dict):
    """part -> bytes, with `add`."""

    def add(self, part: str, nbytes: int) -> None:
        """Add `nbytes` to `part`."""
        self[part] = self.get(part, 0) + int(nbytes)


def norm(led: Ledger, tokens: int, width: int, in_bytes: int, stored_width: int) -> None:
    """RMSNorm: pow saves the fp32 input (the input's own storage when fp32, which may be wider:
    `stored_width`, else an fp32 copy), rsqrt saves [tokens, 1] fp32 and the weight product
    saves the normalized input cast back to the input dtype."""
    x32 = tokens * (stored_width if in_bytes == F32 else width) * F32
    led.add("norms", x32 + tokens * F32 + tokens * width * in_bytes)


def gemm_inputs(led: Ledger, part: str, dt: Dtypes, copies: int, elems: int, shared: int):
    """Inputs saved by `copies` linears reading one activation of `elems` elements stored in
    `shared` bytes each: one storage, or one low-precision copy per linear under autocast."""
    if dt.cast_copies and shared > dt.gemm:
        led.add(part, copies * elems * dt.gemm)
    else:
        led.add(part, elems * shared)
