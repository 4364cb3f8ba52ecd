#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One prepared run of shmcomm's GPU checks, for a machine with a GPU (sized for one H200 and 16 cores: under
# 8 minutes once torch is installed). From the repository root:
#
#   bash benchmarks/gpu_check.sh [OUTPUT_DIR]        # default: $OUT, else ./gpu_check_out
#
# 1. an environment: the venv GPU_CHECK_VENV (default .venv-gpu, made with --system-site-packages so that a torch
#    already installed on the machine is used), shmcomm installed from this checkout (pip install -e), and torch
#    from TORCH_SPEC (default torch==2.13.0; give a CUDA build's wheel or index, e.g.
#    TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130") when the torch there cannot see
#    the GPU. PIP_* variables (PIP_FIND_LINKS, PIP_NO_INDEX) work for a machine without network access;
# 2. what the machine is: nvidia-smi, shmcommrun --check-build;
# 3. the tests: tests/test_gpu_paths.py (the kernels compiled with nvcc, if present) and tests/test_gpu.py (NCCL at
#    1 rank, 2 and 4 ranks sharing the GPU through host memory, DistributedOptimizer against one process, a killed
#    rank named by the others);
# 4. the allreduce sweep, 4 KiB..1 GiB (SWEEP_MAX): shmcomm against torch.distributed with NCCL at 1 rank, and the
#    host path against torch.distributed's gloo (which also stages CUDA tensors through host memory) at 2 and 4
#    ranks sharing the GPU; tables in OUTPUT_DIR/gpu_allreduce.md, raw rows in OUTPUT_DIR/*.jsonl.
# Every step has a time limit; a failed step is reported and the others still run; the exit status is 0 only if
# every step passed. Without a GPU, steps 1-3 run what they can (the GPU tests skip) and the sweep is skipped.
set -u -o pipefail

OUT_DIR=${1:-${OUT:-$PWD/gpu_check_out}}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=${GPU_CHECK_VENV:-.venv-gpu}
SWEEP_MAX=${SWEEP_MAX:-1G}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
TABLES=$OUT_DIR/gpu_allreduce.md
: > "$LOG"
FAILED=()

say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

# attempt NAME SECONDS COMMAND...: runs COMMAND with a time limit, its output into the log; its exit status.
attempt() {
    local name=$1 limit=$2
    shift 2
    say "$name"
    timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || say "$name: exit $rc"
    return $rc
}

# step NAME SECONDS COMMAND...: the same, and a failure is the run's.
step() {
    attempt "$@" || { FAILED+=("$1"); return 1; }
}

# ---- 1. environment ----
if [ ! -x "$VENV/bin/python" ]; then
    step "venv $VENV" 120 python3 -m venv --system-site-packages "$VENV"
fi
PY=$VENV/bin/python
cuda_ok() { "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >> "$LOG" 2>&1; }
# shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
attempt "install shmcomm (-e .[torch,test]) with $TORCH_SPEC" 420 "$PY" -m pip install -q --retries 1 --timeout 20 -e ".[torch,test]" $TORCH_SPEC ||
    step "install shmcomm without dependencies (offline)" 120 "$PY" -m pip install -q --retries 1 --timeout 20 --no-deps --no-build-isolation -e .
if ! cuda_ok; then
    # shellcheck disable=SC2086
    step "install $TORCH_SPEC (the torch found sees no GPU)" 420 "$PY" -m pip install -q --retries 1 --timeout 20 $TORCH_SPEC
fi
GPU=0
cuda_ok && GPU=1

# ---- 2. the machine ----
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } >> "$LOG" 2>&1 || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus',
torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>&1 | tee -a "$LOG"
step "shmcommrun --check-build" 120 "$PY" -m shmcomm.runner --check-build
grep -A12 "Available Tensor Operations" "$LOG" | tail -12

# ---- 3. tests ----
step "tests without a GPU (kernels with nvcc, NCCL's id and version)" 240 \
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_paths.py tests/test_nccl_library.py
step "GPU tests" 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py
grep -E "passed|failed|skipped|SKIPPED" "$LOG" | tail -6

# ---- 4. the sweep ----
sweep() {  # sweep NAME RANKS BACKEND [VAR=VALUE...]
    local name=$1 ranks=$2 backend=$3
    shift 3
    rm -f "$OUT_DIR/$name.jsonl"
    step "sweep $name" 150 env "$@" "$PY" -m shmcomm.runner -np "$ranks" "$PY" -m benchmarks.gpu_allreduce run \
        "$backend" -b 4K -e "$SWEEP_MAX" -t 1.5 --out "$OUT_DIR/$name.jsonl"
}
if [ "$GPU" = 1 ]; then
    : > "$TABLES"
    sweep shmcomm-np1 1 shmcomm
    sweep torch-nccl-np1 1 torch-nccl
    "$PY" -m benchmarks.gpu_allreduce table "1 rank: shmcomm (NCCL path) and torch.distributed NCCL" \
        "$OUT_DIR/shmcomm-np1.jsonl" "$OUT_DIR/torch-nccl-np1.jsonl" >> "$TABLES" 2>> "$LOG"
    for ranks in 2 4; do
        sweep "shmcomm-host-np$ranks" "$ranks" shmcomm SHMCOMM_GPU_PATH=host
        sweep "torch-gloo-np$ranks" "$ranks" torch-gloo
        "$PY" -m benchmarks.gpu_allreduce table "$ranks ranks on one GPU: shmcomm's host path and torch.distributed gloo" \
            "$OUT_DIR/shmcomm-host-np$ranks.jsonl" "$OUT_DIR/torch-gloo-np$ranks.jsonl" >> "$TABLES" 2>> "$LOG"
    done
    cat "$TABLES"
else
    say "no GPU visible to torch: the sweep is skipped"
    FAILED+=("no GPU")
fi

ls /dev/shm | grep -i shmcomm >> "$LOG" 2>&1 && say "segments left in /dev/shm (see the log)"
if [ ${#FAILED[@]} -eq 0 ]; then
    say "all steps passed; log $LOG, tables $TABLES"
    exit 0
fi
say "failed: ${FAILED[*]}; log $LOG"
exit 1
