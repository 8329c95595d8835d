"""The equal-group expert GEMMs on one CPU thread, by a small C kernel built on first use.

`batched_swiglu` computes forward and backward of E experts with C rows each as four GEMM
stages (gate+up forward, down forward, down backward, gate+up backward). Where batched BLAS
(`torch.bmm`) runs them, each small expert's weight block is packed by its own GEMM, and with
many experts (their weights in DRAM) that reads the weights well below the memory bandwidth:
128 experts cost about 1.5x the time of 8 at equal FLOPs. The C kernel
(`kernels/expert_gemm_avx2.c`) reads each expert's weights directly while it prefetches the
next expert's into L2, so the weights stream while the arithmetic runs.

It runs where all of this holds, else the bmm stages do (same results up to fp32 rounding):
x86-64 with AVX2 and FMA, fp32 plain contiguous CPU tensors, one intra-op thread
(`torch.get_num_threads() == 1`, as every rank of a multi-process CPU run has; with more
threads bmm uses them), eager mode (not inside torch.compile or a dispatch mode), a C
compiler on the machine (`$CC`, else `cc`, else `gcc`), and `NANOTRAIN_CPU_EXPERT_KERNEL`
not set to 0. The shared library is compiled once per machine into `kernel_cache_dir()`,
named by a hash of source, flags and compiler, and loaded with ctypes; a failed build warns
once and leaves bmm in use.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_SOURCE = Path(__file__).with_name("kernels") / "expert_gemm_avx2.c"
_FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c99")
_ENTRY_POINTS = (
    "expert_gate_up_forward",
    "expert_down_forward",
    "expert_down_backward",
    "expert_gate_up_backward",
)
_library: ctypes.CDLL | None = None
_load_tried = False


def kernel_cache_dir() -> Path:
    """Where the compiled kernel is kept: $NANOTRAIN_KERNEL_CACHE, else
    $XDG_CACHE_HOME/nanotrain/kernels, else ~/.cache/nanotrain/kernels. Not under
    $NANOTRAIN_CACHE (the data cache), which runs and tests often point at a fresh folder:
    one build per machine serves them all."""
    if os.environ.get("NANOTRAIN_KERNEL_CACHE"):
        return Path(os.environ["NANOTRAIN_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nanotrain" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    """Compile the kernel unless a build of this source, flags and compiler exists. Writes to
    a temporary name and renames, so ranks that build at once never load a torn file."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    digest = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), *_FLAGS, version]).encode()
    ).hexdigest()[:16]
    cache = kernel_cache_dir()
    target = cache / f"expert_gemm_avx2-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", tmp],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None where it cannot run (warned once)."""
    global _library, _load_tried
    if _load_tried:
        return _library
    _load_tried = True
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    compiler = _compiler()
    if compiler is None:
        warnings.warn(
            "no C compiler found (set CC): the CPU expert kernel is not built and the "
            "experts run as batched BLAS GEMMs (correct, slower with many experts)",
            stacklevel=3,
        )
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(
            f"building the CPU expert kernel with {compiler} failed ({detail}); the experts "
            "run as batched BLAS GEMMs (correct, slower with many experts). Set "
            "NANOTRAIN_CPU_EXPERT_KERNEL=0 to skip the build.",
            stacklevel=3,
        )
        return None
    for name in _ENTRY_POINTS:
        getattr(library, name).restype = ctypes.c_int
    _library = library
    return _library


def cpu_kernel_runs(*tensors: torch.Tensor) -> bool:
    """Whether the C kernel computes the batched GEMMs of these tensors (x and the three
    weight stacks): see the module docstring for the conditions. Builds it on first use."""
    if torch.compiler.is_compiling():
        return False  # first: a compiled graph traces the bmm stages (and nothing below)
    if os.environ.get("NANOTRAIN_CPU_EXPERT_KERNEL", "1") == "0" or torch.get_num_threads() != 1:
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return False  # fake, meta-like or other subclasses hold no host data to hand to C
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return False
    return _load() is not None


def _args(*values: int | torch.Tensor) -> list[ctypes.c_long | ctypes.c_void_p]:
    return [
        ctypes.c_void_p(v.data_ptr()) if isinstance(v, torch.Tensor) else ctypes.c_long(v)
        for v in values
    ]


def _call(name: str, *values: int | torch.Tensor) -> None:
    library = _load()
    assert library is not None, "cpu_kernel_runs() chose the kernel"
    if getattr(library, name)(*_args(*values)) != 0:
        raise MemoryError(f"{name}: out of memory for a 16-column panel")


class KernelGemms:
    """The four GEMM stages of `batched_swiglu` by the C kernel (see `BmmGemms` for shapes).
    Every input must be contiguous fp32 on the CPU (the caller checks `cpu_kernel_runs`)."""

    @staticmethod
    def gate_up_forward(xb, gate, up):  # noqa: ANN001, ANN205
        e, c, h = xb.shape
        g = xb.new_empty(e, c, gate.shape[1])
        u = torch.empty_like(g)
        _call("expert_gate_up_forward", e, c, h, gate.shape[1], xb, gate, up, g, u)
        return g, u

    @staticmethod
    def down_forward(a, down):  # noqa: ANN001, ANN205
        e, c, i = a.shape
        y = a.new_empty(e, c, down.shape[1])
        _call("expert_down_forward", e, c, down.shape[1], i, a.contiguous(), down, y)
        return y

    @staticmethod
    def down_backward(dy, a, down):  # noqa: ANN001, ANN205
        e, c, h = dy.shape
        d_down, da = torch.empty_like(down), torch.empty_like(a)
        _call("expert_down_backward", e, c, h, a.shape[2], dy, a.contiguous(), down, d_down, da)
        return d_down, da

    @staticmethod
    def gate_up_backward(dg, du, xb, gate, up):  # noqa: ANN001, ANN205
        e, c, i = dg.shape
        d_gate, d_up, dx = torch.empty_like(gate), torch.empty_like(up), torch.empty_like(xb)
        _call(
            "expert_gate_up_backward", e, c, xb.shape[2], i,
            dg.contiguous(), du.contiguous(), xb, gate, up, d_gate, d_up, dx,
        )  # fmt: skip
        return d_gate, d_up, dx
