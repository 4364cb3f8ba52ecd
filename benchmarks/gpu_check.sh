#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# shmcomm's GPU checks in one call on a machine with a GPU and no network, in at most 6 minutes. From the repository
# root:
#
#   bash benchmarks/gpu_check.sh --prepare     # where pip works: the wheels the GPU machine lacks, into
#                                              # benchmarks/.gpu_wheels (cffi and pycparser, for Python 3.12 and for
#                                              # this machine's python3); carry that folder to the GPU machine
#   bash benchmarks/gpu_check.sh [OUTPUT_DIR]  # there (default: $OUT, else ./gpu_check_out)
#
# The second form uses the machine's python3 as it is (GPU_CHECK_PYTHON names another): torch, numpy and pytest must
# be there. It unpacks the carried wheels into .gpu_check/site (on PYTHONPATH; nothing is installed), builds the core
# in place, and runs each step under its own time limit and one deadline for all (GPU_CHECK_SECONDS, 330):
#   check-build; a 2-rank CPU job; tests/gpu_smoke.py (one process: NCCL communicators, every dtype and op, the
#   torus's steps, the CUDA kernels against torch); the tests that need no GPU; tests/test_gpu.py (the launcher's jobs on CUDA tensors);
#   allreduce sweeps 4 KiB..256 MiB (SWEEP_MAX): 1 rank, shmcomm against torch.distributed NCCL; 2 ranks sharing the
#   GPU, shmcomm's host path against gloo.
# OUTPUT_DIR gets gpu_check.log, gpu_allreduce.md and the sweeps' rows (*.jsonl): 6 files. Exit status: 0 when every
# step passed on a GPU, 3 when every step that needs no GPU passed and torch saw none (each GPU step then says "no
# GPU"), 4 when every step that ran passed but the deadline left some out, 1 when a step failed.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$ROOT/benchmarks/.gpu_wheels
PY=${GPU_CHECK_PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
    here=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || exit 1
    mkdir -p "$WHEELS"
    for version in 3.12 "$here"; do
        tag=cp${version/./}
        "$PY" -m pip download -q --only-binary=:all: --python-version "$version" --implementation cp --abi "$tag" \
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" cffi pycparser || exit 1
    done
    ls -l "$WHEELS"
    exit 0
fi

OUT_DIR=${1:-${OUT:-$PWD/gpu_check_out}}
SWEEP_MAX=${SWEEP_MAX:-256M}
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-330}))
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
TABLES=$OUT_DIR/gpu_allreduce.md
: > "$LOG"
FAILED=()
NO_GPU=()
LATE=()

say() { echo "== $(date -u +%H:%M:%S) +${SECONDS}s $*" | tee -a "$LOG"; }

# step NAME SECONDS COMMAND...: runs COMMAND, its output into the log, for at most SECONDS and never past the
# deadline; a failure is recorded and the next step still runs.
step() {
    local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
    shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        say "$name: not run, the run's deadline has come"
        LATE+=("$name")
        return 1
    fi
    say "$name (at most ${limit}s)"
    timeout --kill-after=5 "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    if [ $rc -ne 0 ]; then
        say "$name: exit $rc$([ $rc -eq 124 ] && echo ' (its time limit)')"
        FAILED+=("$name")
    fi
    return $rc
}

# gpu_step NAME SECONDS COMMAND...: a step that needs a GPU; without one it says so instead.
gpu_step() {
    if [ "$GPU" = 1 ]; then
        step "$@"
    else
        say "$1: no GPU (torch.cuda.is_available() is False)"
        NO_GPU+=("$1")
    fi
}

# ---- 1. the environment: the carried wheels, the core built in place ----
cd "$ROOT" || exit 1
SITE=$ROOT/.gpu_check/site
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
unpack_wheels() {
    "$PY" - "$WHEELS" "$SITE" <<'EOF'
import glob, os, sys, zipfile
wheels, site = sys.argv[1:]
tag = "cp%d%d" % sys.version_info[:2]
os.makedirs(site, exist_ok=True)
for name in ("cffi", "pycparser"):
    try:
        __import__(name)
        print(name, "is already importable")
        continue
    except ImportError:
        pass
    found = [w for w in sorted(glob.glob(os.path.join(wheels, name + "-*.whl")))
             if "-py3-none-any" in w or "-%s-%s-" % (tag, tag) in w]
    if not found:
        sys.exit("no %s wheel for %s in %s: run bash benchmarks/gpu_check.sh --prepare where pip works"
                 % (name, tag, wheels))
    zipfile.ZipFile(found[-1]).extractall(site)
    print("unpacked", os.path.basename(found[-1]))
import cffi, pycparser
print("cffi", cffi.__version__, "pycparser", pycparser.__version__)
EOF
}
mkdir -p "$SITE"  # before any python starts: a folder on PYTHONPATH that did not exist then is never looked in
export -f unpack_wheels
export PY WHEELS SITE
say "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1)"
step "wheels" 30 bash -c unpack_wheels
step "build the core in place" 150 "$PY" setup.py -q build_ext --inplace

# ---- 2. the machine ----
GPU=0
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >> "$LOG" 2>&1 && GPU=1
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } >> "$LOG" 2>&1 || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus',
torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>&1 | tee -a "$LOG"
step "shmcommrun --check-build" 60 "$PY" -m shmcomm.runner --check-build

# ---- 3. checks and tests ----
step "a 2-rank job through shmcommrun (no MPI library needed on one host)" 60 "$PY" -m shmcomm.runner -np 2 "$PY" -c "
import torch, shmcomm.torch as hvd
hvd.init()
total = hvd.allreduce(torch.full((4,), hvd.rank() + 1.0), op=hvd.Sum)
assert total.tolist() == [3.0] * 4, total
print('ok: rank', hvd.rank(), 'of', hvd.size())"
step "NCCL and CUDA kernels in one process (tests/gpu_smoke.py; without a GPU only NCCL's loading)" 90 "$PY" tests/gpu_smoke.py
step "tests without a GPU (NCCL's loader, paths, kernels with nvcc)" 60 \
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_paths.py tests/test_nccl_library.py
gpu_step "GPU tests (tests/test_gpu.py)" 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py

# ---- 4. the sweeps ----
sweep() {  # sweep NAME RANKS BACKEND [VAR=VALUE...]
    local name=$1 ranks=$2 backend=$3
    shift 3
    rm -f "$OUT_DIR/$name.jsonl"
    gpu_step "sweep $name" 45 env "$@" "$PY" -m shmcomm.runner -np "$ranks" "$PY" -m benchmarks.gpu_allreduce run \
        "$backend" -b 4K -e "$SWEEP_MAX" -t 1.0 --out "$OUT_DIR/$name.jsonl"
}
sweep shmcomm-np1 1 shmcomm
sweep torch-nccl-np1 1 torch-nccl
sweep shmcomm-host-np2 2 shmcomm SHMCOMM_GPU_PATH=host
sweep torch-gloo-np2 2 torch-gloo
if [ "$GPU" = 1 ]; then
    {
        "$PY" -m benchmarks.gpu_allreduce table "1 rank: shmcomm (NCCL path) and torch.distributed NCCL" \
            "$OUT_DIR/shmcomm-np1.jsonl" "$OUT_DIR/torch-nccl-np1.jsonl"
        "$PY" -m benchmarks.gpu_allreduce table "2 ranks on one GPU: shmcomm's host path and torch.distributed gloo" \
            "$OUT_DIR/shmcomm-host-np2.jsonl" "$OUT_DIR/torch-gloo-np2.jsonl"
    } > "$TABLES" 2>> "$LOG"
    cat "$TABLES"
fi

ls /dev/shm 2>/dev/null | grep -i shmcomm >> "$LOG" && say "segments left in /dev/shm (see the log)"
if [ ${#FAILED[@]} -gt 0 ]; then
    say "failed: ${FAILED[*]}; log $LOG"
    exit 1
fi
if [ ${#LATE[@]} -gt 0 ]; then
    say "the deadline left out: ${LATE[*]}; every step that ran passed; log $LOG"
    exit 4
fi
if [ ${#NO_GPU[@]} -gt 0 ]; then
    say "no GPU: ${#NO_GPU[@]} GPU steps did not run; every other step passed; log $LOG"
    exit 3
fi
say "all steps passed in ${SECONDS}s; log $LOG, tables $TABLES"
exit 0
