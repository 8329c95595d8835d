#!/usr/bin/env bash
# Every GPU check of this repository in one command, for a short lease of one GPU machine:
#   bash benchmarks/gpu_session.sh [OUT_DIR [PART...]]   (logs go to OUT_DIR, default $OUT or
#   /tmp/gpu; PARTs, e.g. `tests fit`, run only those parts; default: the user's-path parts
#   tests fit fp8 plan graphs peer)
# The user's path (`benchmarks/gpu_fit.py`, run reports kept under OUT_DIR/fit/...):
#   tests   the CUDA-only tests (they skip on CPU machines: torchao fp8, CUDA graphs, ...), one
#           line per test (a hung test shows by name)
#   fit     `nanotrain fit` on dense-1b and moe-1b in bf16-true, compiled, beside the bare loop
#   fp8     dense-3b, bf16-mixed against torchao-float8, 200 steps: tokens/s and loss gap
#   plan    the planner's memory against the allocator's; the largest micro-batch it allows
#   graphs  moe-1b under the Trainer with CUDA graphs (bf16-true)
#   peer    torchtitan's Llama-3 beside the nanotrain Trainer and bare loop at the dense-1b
#           shape, bf16-mixed, compiled, in one process: tokens/s, MFU and the ratio
#           (benchmarks/peer_torchtitan.py; 55 s on an H200)
#   overhead  the Trainer's per-step cost against a plain loop and lightning.Trainer on the GPU,
#           logging every step (benchmarks/overhead.py --device cuda, a launch-bound and a
#           ~2 ms model), the host syncs while logging (--sync-check), the ops and Python
#           calls per step on the GPU path (--count-host-work) and where the logging runs
#           spend host time (--host-profile)
#   overheadcpu  benchmarks/overhead.py's CPU table on this machine's (quiet) CPU
#   recompute  the activations autograd keeps on the GPU path (fused attention, grouped-GEMM
#           experts, fp8 expert saves) by recompute mode, beside the planner's figure
#           (benchmarks/recompute.py --device cuda)
# Earlier checks, by name only: sync, syncsource (host syncs of the Trainer), nccl (every
# strategy on one NCCL rank), experts (expert layer by number of experts), moe, dense (the
# bare loop's MFU). Each part has its own time limit, so one slow part cannot starve the
# others; the summary at the end repeats the result lines of every part. The default parts'
# limits add up to 10 minutes; their real times on an H100 have not been measured yet.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu}}"
wanted=("${@:2}")
[ ${#wanted[@]} -gt 0 ] || wanted=(tests fit fp8 plan graphs peer)
parts=" tests fit fp8 plan graphs peer overhead overheadcpu recompute sync syncsource nccl experts moe dense "
for name in "${wanted[@]}"; do
    if [[ "$parts" != *" $name "* ]]; then
        echo "unknown part '$name'; the parts are:$parts" >&2
        exit 2
    fi
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Packages a bare GPU image lacks (jsonargparse for the CLI, torchao for fp8, torchtitan and
# tyro for the peer part) can travel as wheels in .whl/ (ignored by git; name it in the device
# call's carry), downloaded beforehand:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl jsonargparse docstring-parser typeshed-client \
#       torchao torchtitan==0.2.2 tyro
# (torchtitan 0.3 needs a torch newer than 2.11: see benchmarks/peer_torchtitan.py)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    if [ ${#wanted[@]} -gt 0 ] && [[ " ${wanted[*]} " != *" $name "* ]]; then
        return
    fi
    local t0=$SECONDS
    # -k: a fit catches SIGTERM to save and stop after its step, which a hung step never ends
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/$name.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'grouped_mm', hasattr(torch.nn.functional, 'grouped_mm'))"
    python3 -c "import transformer_engine; print('transformer_engine', transformer_engine.__version__)" 2>&1 | tail -1
} >"$out/env.log" 2>&1
cat "$out/env.log"

# the CLI test needs jsonargparse, a core dependency that a bare GPU image may lack
skip=()
python3 -c "import jsonargparse" 2>/dev/null ||
    skip=(--deselect tests/unit/test_precision.py::test_cli_flag_reaches_the_strategy)
part tests 90 python3 -m pytest -v -p no:cacheprovider "${skip[@]}" \
    tests/unit/test_expert_compute.py tests/unit/test_layout_numbers.py \
    tests/unit/test_callbacks_monitors.py tests/unit/test_single_device.py \
    tests/unit/test_megatron_device.py tests/unit/test_precision.py \
    tests/unit/test_precision_torchao.py tests/unit/test_cuda_graphs.py
part fit 150 python3 benchmarks/gpu_fit.py --out "$out/fit" --precision bf16-true
part fp8 120 python3 benchmarks/gpu_fit.py --out "$out/fit" --preset dense-3b \
    --precision bf16-mixed,torchao-float8 --steps 200 --log-every 20 --no-bare
part plan 90 python3 benchmarks/gpu_fit.py --out "$out/fit" --plan-memory --precision bf16-true
part graphs 30 python3 benchmarks/gpu_fit.py --out "$out/fit" --preset moe-1b \
    --precision bf16-true --compile cudagraphs --no-bare
part peer 120 python3 benchmarks/peer_torchtitan.py
part overhead 240 bash -c "python3 benchmarks/overhead.py --device cuda --sync-check;
    python3 benchmarks/overhead.py --device cuda --count-host-work --width 256;
    python3 benchmarks/overhead.py --device cuda --host-profile --width 256;
    python3 benchmarks/overhead.py --device cuda --width 256 --steps 300 --rounds 5;
    python3 benchmarks/overhead.py --device cuda --width 2048 --batch 1024 --steps 200 --rounds 3"
part overheadcpu 150 python3 benchmarks/overhead.py --width 256 --steps 300 --rounds 5
part recompute 90 bash -c "python3 benchmarks/recompute.py --device cuda --precision bf16-mixed \
    --batch 2 --seq-len 2048; python3 benchmarks/recompute.py --device cuda --precision bf16-true \
    --batch 1 --seq-len 2048"
part sync 120 python3 benchmarks/gpu.py --sync-check-only
part syncsource 200 python3 benchmarks/gpu.py --find-syncs ddp:bf16-mixed --find-syncs ddp:bf16-true \
    --find-syncs single:bf16-mixed --find-syncs single:bf16-true \
    --find-syncs megatron:bf16-mixed --find-syncs megatron:bf16-true
part nccl 120 python3 benchmarks/nccl_check.py
part experts 90 python3 benchmarks/gpu.py --no-sync-check --experts-only
part moe 200 python3 benchmarks/gpu.py --no-sync-check --preset moe-1b --compile model,cudagraphs --steps 10 --profile
part dense 120 python3 benchmarks/gpu.py --no-sync-check --preset dense-1b --compile model --steps 10
echo "== summary"
grep -sh "^| \|gap of\|largest micro-batch\|exit " "$out/fit.log" "$out/fp8.log" "$out/plan.log" "$out/graphs.log"
grep -sh "FAILED\|passed\|failed\|error" "$out/tests.log" | tail -8
grep -sh "^| \|^peer" "$out/peer.log"
grep -sh "^| \|^deepseek" "$out/recompute.log"
grep -sh "^sync check\|^  step\|^steps=\|^[a-z ]*loop\|^nanotrain\|^lightning" "$out/overhead.log" "$out/overheadcpu.log"
grep -sh -A8 "^Python functions\|^ops and CUDA" "$out/overhead.log" | cut -c1-160
grep -sh "^sync check\|^  [0-9]*x " "$out/sync.log"
grep -sh "^sync sources\|^  [0-9]*x \|^  steady" "$out/syncsource.log" | cut -c1-400
grep -sh "matches single\|bf16-mixed  \|bf16-true  \|NCCL check\|Error" "$out/nccl.log"
grep -sh "^| \|Error\|bandwidth\|skipping cudagraphs" "$out/dense.log" "$out/moe.log" "$out/experts.log"
grep -sh "^== " "$out"/*.log
