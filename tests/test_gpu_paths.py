# SPDX-License-Identifier: Apache-2.0
"""What of the GPU support runs without a GPU: the choice of path from the ranks' device descriptions, the torus
layout on NCCL communicators, the bounded wait's decisions, the CUDA kernels compiled with nvcc (where nvcc is) and
their exported symbols, NCCL's refusal of a bad id, and the typed errors a CUDA tensor meets where CUDA is missing.
tests/test_gpu.py holds the tests that need a GPU."""
import ctypes
import os
import shutil
import subprocess
import sys

import pytest

from shmcomm.startup import devices
from shmcomm.vocabulary import dtypes
from shmcomm.algorithms import device_buffers, nccl_torus
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError
from shmcomm.transport import cuda_kernels, nccl, nccl_library

# ---- which path: every rank decides alike from the same descriptions ----


def _gpu(host, index, uuid=None, pci=None):
    return devices.describe(host, index, uuid, pci)


def test_ranks_with_a_gpu_each_take_nccl():
    everyone = [_gpu("a", 0, "GPU-1"), _gpu("a", 1, "GPU-2"), _gpu("b", 0, "GPU-3"), _gpu("b", 1, "GPU-4")]
    assert devices.choose_path(everyone) == ("nccl", "every rank has a GPU of its own")
    assert devices.shared_devices(everyone) == []
    assert devices.choose_path([_gpu("a", 0, "GPU-1")])[0] == "nccl"  # one rank: NCCL's communicator of one


def test_ranks_sharing_a_gpu_go_through_the_host_and_are_named():
    # CUDA_VISIBLE_DEVICES gives both ranks ordinal 0 of different devices: the UUID tells them apart...
    apart = [_gpu("a", 0, "GPU-1"), _gpu("a", 0, "GPU-2")]
    assert devices.choose_path(apart)[0] == "nccl"
    # ...and names the same device behind different ordinals.
    same = [_gpu("a", 0, "GPU-1"), _gpu("a", 1, "GPU-2"), _gpu("a", 3, "gpu-1")]
    path, why = devices.choose_path(same)
    assert path == "host" and "ranks 0, 2 share the GPU GPU-1 on host a" in why
    assert devices.shared_devices(same) == [([0, 2], same[0])]


def test_the_pci_address_and_then_the_ordinal_identify_a_device():
    assert devices.choose_path([_gpu("a", 0, pci="0000:17:00"), _gpu("a", 1, pci="0000:17:00")])[0] == "host"
    assert devices.choose_path([_gpu("a", 0), _gpu("a", 0)])[0] == "host"
    assert devices.choose_path([_gpu("a", 0), _gpu("a", 1)])[0] == "nccl"
    assert devices.choose_path([_gpu("a", 0), _gpu("b", 0)])[0] == "nccl"  # same ordinal, other host


def test_the_path_can_be_forced_and_nccl_on_a_shared_gpu_is_refused():
    own = [_gpu("a", 0, "GPU-1"), _gpu("a", 1, "GPU-2")]
    shared = [_gpu("a", 0, "GPU-1"), _gpu("a", 0, "GPU-1")]
    assert devices.choose_path(own, "host") == ("host", "SHMCOMM_GPU_PATH=host")
    assert devices.choose_path(own, "NCCL")[0] == "nccl"
    with pytest.raises(InvalidArgumentError, match="ranks 0, 1 share the GPU GPU-1 .* NCCL needs a GPU per rank"):
        devices.choose_path(shared, "nccl")
    with pytest.raises(InvalidArgumentError, match="SHMCOMM_GPU_PATH='gpu'"):
        devices.choose_path(own, "gpu")


# ---- the torus on NCCL communicators ----


def test_the_torus_layout_follows_the_path_settings_and_the_hosts():
    two_hosts = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert nccl_torus.layout(8, two_hosts, "auto", None) == (4, 2)
    assert nccl_torus.layout(8, two_hosts, "torus", None) == (4, 2)
    assert nccl_torus.layout(8, two_hosts, "ring", None) is None  # NCCL's own ring or tree, in one call
    assert nccl_torus.layout(8, two_hosts, "mpi", None) is None
    assert nccl_torus.layout(4, [[0, 1, 2, 3]], "auto", None) is None  # one host: one allreduce
    assert nccl_torus.layout(4, [[0, 1, 2, 3]], "auto", (2, 2)) == (2, 2)  # SHMCOMM_TORUS_GRID on one host
    assert nccl_torus.layout(4, [[0, 1, 2, 3]], "auto", (4, 1)) is None  # a grid of one row is one allreduce
    interleaved = [[0, 2], [1, 3]]
    assert nccl_torus.layout(4, interleaved, "auto", None) is None
    with pytest.raises(InvalidArgumentError, match="consecutive"):
        nccl_torus.layout(4, interleaved, "torus", None)
    with pytest.raises(InvalidArgumentError, match="unequal|consecutive"):
        nccl_torus.layout(5, [[0, 1, 2], [3, 4]], "torus", None)


def test_rows_and_columns_for_the_split():
    # A 3x2 grid: rows are 3 consecutive ranks, columns every third; colors and keys as ncclCommSplit wants them.
    assert nccl_torus.row_and_column(4, 3, 2) == ((1, 1, [3, 4, 5]), (1, 1, [1, 4]))
    assert nccl_torus.row_and_column(0, 3, 2) == ((0, 0, [0, 1, 2]), (0, 0, [0, 3]))
    every = [nccl_torus.row_and_column(r, 3, 2) for r in range(6)]
    for r, (row, column) in enumerate(every):
        assert row[2][row[1]] == r and column[2][column[1]] == r  # the key is the rank's place in its communicator
    assert [nccl_torus.padded_count(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]


# ---- the bounded wait ----


class _Clock:
    """Time that advances a microsecond per reading and by what the wait sleeps, so that the decisions are checked,
    not the timings."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1e-6
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_the_wait_returns_when_done_and_stops_at_an_error_a_dead_rank_or_the_deadline():
    clock = _Clock()
    polls = iter([False, False, True])
    assert nccl.wait_for(lambda: next(polls), lambda: 0, 10.0, clock=clock, sleep=clock.sleep) is None
    # ncclInProgress is not an error; ncclRemoteError (6) is.
    codes = iter([nccl_library.IN_PROGRESS, 0, 6])
    assert nccl.wait_for(lambda: False, lambda: next(codes), 10.0, clock=clock, sleep=clock.sleep) == ("error", 6)
    clock = _Clock()
    dead = iter([[], [], [3]])
    assert nccl.wait_for(lambda: False, lambda: 0, 10.0, lambda: next(dead), clock=clock,
                         sleep=clock.sleep) == ("dead", [3])
    clock = _Clock()
    reason, waited = nccl.wait_for(lambda: False, lambda: 0, 2.0, clock=clock, sleep=clock.sleep)
    assert reason == "timeout" and 2.0 < waited < 2.01


# ---- NCCL without a GPU ----

needs_nccl = pytest.mark.skipif(nccl_library.find() is None, reason="no NCCL library (pip install nvidia-nccl-cu13)")


@needs_nccl
def test_a_bad_unique_id_is_refused_before_nccl_sees_it():
    with pytest.raises(nccl_library.NcclError, match="128 bytes, got 5"):
        nccl.NcclComm.create(b"short", 0, [0], 5.0)


@needs_nccl
def test_a_communicator_without_a_gpu_fails_with_nccls_words():
    """A real ncclCommInitRank of one rank where there is no GPU: a typed error with NCCL's message, not a crash
    (in a subprocess: NCCL's failed initialisation must not linger in the test process)."""
    code = ("from shmcomm.transport import nccl, nccl_library\n"
            "lib = nccl_library.load()\n"
            "try:\n"
            "    nccl.NcclComm.create(lib.unique_id(), 0, [0], 60.0, library=lib)\n"
            "except nccl_library.NcclError as e:\n"
            "    print('refused', e.result, e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if "refused" not in done.stdout and done.returncode == 0:
        pytest.skip("this machine has a GPU: the communicator was created")
    assert done.stdout.startswith("refused "), done.stdout + done.stderr
    assert "ncclCommInitRank (rank 0 of 1) failed: " in done.stdout


# ---- CUDA tensors where CUDA is missing ----


def test_cuda_tensors_without_cuda_raise_a_typed_error():
    torch = pytest.importorskip("torch")
    from shmcomm.algorithms import device

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    with pytest.raises(InvalidArgumentError, match="need a CUDA build of torch and a visible GPU"):
        device.require_cuda(torch)
    with pytest.raises(InvalidArgumentError, match="need a CUDA build of torch"):
        device.DeviceComm(object())
    with pytest.raises(InvalidArgumentError, match="tensor is on meta; shmcomm moves CPU and CUDA tensors only"):
        from shmcomm.vocabulary.buffers import wrap

        wrap(torch.empty(3, device="meta"), "allreduce")


def test_a_cuda_tensor_is_a_different_dtype_from_a_cpu_one():
    """Ranks passing a CUDA tensor where others pass a CPU one disagree (and the engine never fuses them)."""
    torch = pytest.importorskip("torch")
    from shmcomm.vocabulary import description
    from shmcomm.vocabulary.buffers import Buffer
    from shmcomm.engine import fusion

    code = dtypes.torch_codes()[torch.float32]
    cpu = Buffer(None, None, 4, code, 4, (4,), True)
    gpu = Buffer(None, None, 4, code, 4, (4,), True, on_device=True)
    assert gpu.dtype_key() == code + dtypes.DEVICE_KEY != cpu.dtype_key()
    assert dtypes.device_code(gpu.dtype_key()) == code and dtypes.device_code(cpu.dtype_key()) is None
    assert description.dtype_name(gpu.dtype_key()) == "cuda float32"
    assert fusion.itemsize(gpu.dtype_key()) == fusion.itemsize(cpu.dtype_key()) == 4
    odd = Buffer(torch.empty(1, dtype=torch.bool), None, 1, None, 1, (1,), True)
    odd_gpu = Buffer(torch.empty(1, dtype=torch.bool), None, 1, None, 1, (1,), True, on_device=True)
    assert odd.dtype_key() != odd_gpu.dtype_key() and min(odd.dtype_key(), odd_gpu.dtype_key()) >= 1000


# ---- the CUDA kernels ----

needs_nvcc = pytest.mark.skipif(cuda_kernels.nvcc() is None, reason="no nvcc: the CUDA kernels are not built here")


@needs_nvcc
@pytest.mark.slow
def test_the_kernels_compile_with_nvcc_and_export_their_symbols(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMCOMM_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("SHMCOMM_CUDA_ARCHS", "75")
    path = cuda_kernels.build(cuda_kernels.archs())
    assert path.parent.parent == tmp_path / "cuda-kernels" and path.name == cuda_kernels.LIBRARY
    nm = shutil.which("nm")
    if nm:
        exported = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
        symbols = {line.split()[-1] for line in exported.splitlines() if " T " in line}
        assert {"smc_cuda_abi_version", "smc_cuda_probe", "smc_cuda_scale", "smc_cuda_copy_batch"} <= symbols
    # The runtime is linked in: the library loads without a GPU or a libcudart, and answers its interface version.
    assert ctypes.CDLL(str(path)).smc_cuda_abi_version() == cuda_kernels.ABI_VERSION
    try:
        assert cuda_kernels.Kernels(path).path == str(path)  # a GPU that runs them
    except RuntimeError as error:  # no GPU or an old driver: the load's probe launch says so, and load() steps aside
        assert "shmcomm CUDA kernel probe failed to launch (CUDA error" in str(error)
        monkeypatch.setattr(cuda_kernels, "_loaded", {})
        assert cuda_kernels.load() is None and "kernel probe failed" in cuda_kernels.unavailable()
    # A second build of the same source and flags is the cached one.
    assert cuda_kernels.build(cuda_kernels.archs()) == path
    assert sorted(p.name for p in (tmp_path / "cuda-kernels").iterdir()) == [".lock", path.parent.name]


def test_without_nvcc_the_kernels_are_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("SHMCOMM_CUDA_ARCHS", "61")  # an entry of its own in the module's cache
    assert cuda_kernels.nvcc() is None
    assert cuda_kernels.load() is None
    assert "nvcc was not found" in cuda_kernels.unavailable()


def test_the_architectures_come_from_the_setting_or_the_device(monkeypatch):
    monkeypatch.delenv("SHMCOMM_CUDA_ARCHS", raising=False)
    assert cuda_kernels.archs((9, 0)) == ["90"] and cuda_kernels.archs() == ["75"]
    monkeypatch.setenv("SHMCOMM_CUDA_ARCHS", "80,90")
    assert cuda_kernels.archs((9, 0)) == ["80", "90"]
    line = cuda_kernels.command("nvcc", "k.cu", "k.so", ["80", "90"])
    assert "-gencode=arch=compute_80,code=sm_80" in line and "-gencode=arch=compute_80,code=compute_80" in line
    assert "-cudart" in line and line[line.index("-cudart") + 1] == "static"


def test_the_package_imports_without_torch_cuda_or_nvcc():
    code = ("import sys; import shmcomm, shmcomm.startup.devices, shmcomm.transport.nccl, shmcomm.transport.cuda_kernels, "
            "shmcomm.algorithms.nccl_torus; assert 'torch' not in sys.modules; print('ok')")
    env = dict(os.environ, PATH="/nonexistent")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def test_the_sweeps_table_puts_the_backends_side_by_side(tmp_path, capsys):
    """benchmarks/gpu_allreduce.py's table (the sweep itself needs a GPU): rows by size, each file's backend, and
    the time ratio against the first; shmcommrun's rank prefix is read through."""
    from benchmarks import gpu_allreduce

    ours, theirs = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    row = '{"backend": "%s", "np": 2, "bytes": %d, "time_us": %s, "algbw": 1.0, "busbw": %s, "iterations": 5}\n'
    ours.write_text(row % ("shmcomm", 4096, 30.0, 0.25) + row % ("shmcomm", 16384, 40.0, 0.5))
    theirs.write_text("[0]<stdout>: " + row % ("torch-gloo", 4096, 90.0, 0.125))
    gpu_allreduce.main(["table", "2 ranks", str(ours), str(theirs)])
    lines = capsys.readouterr().out.splitlines()
    assert "| bytes | shmcomm us | torch-gloo us | shmcomm busbw GB/s | torch-gloo busbw GB/s |" in lines[2]
    assert lines[4] == "| 4096 | 30.0 | 90.0 | 0.25 | 0.12 | 3.00 |"
    assert lines[5] == "| 16384 | 40.0 | - | 0.50 | - | - |"
    assert gpu_allreduce.sweep(4096, 1 << 30, 4)[-1] == 1 << 30


def test_where_a_rank_cannot_load_nccl_auto_stages_through_host_memory_and_nccl_is_refused():
    own = [_gpu("a", 0, "GPU-1"), devices.describe("a", 1, "GPU-2", nccl_problem="NCCL not found: set ...")]
    assert devices.choose_path(own) == ("host", "rank 1 cannot load NCCL (NCCL not found: set ...): staging "
                                                "through host memory")
    with pytest.raises(InvalidArgumentError, match=r"SHMCOMM_GPU_PATH=nccl, but rank 1 cannot load NCCL"):
        devices.choose_path(own, "nccl")
    assert devices.choose_path(own, "host") == ("host", "SHMCOMM_GPU_PATH=host")


def test_every_dtype_the_host_path_reduces_nccl_reduces_too():
    """A call must not behave by path: int16, which NCCL lacks, is reduced as int32 and narrowed back, wrapping as
    int16 arithmetic does (shown here on CPU tensors: the same torch operations run on the device)."""
    torch = pytest.importorskip("torch")
    for dtype in dtypes.torch_codes():
        wide = device_buffers.widened(torch, torch.zeros(3, dtype=dtype))
        assert device_buffers.nccl_dtype(wide, "allreduce") in nccl_library.DTYPES, dtype
    x = torch.tensor([30000, -30000, 7], dtype=torch.int16)
    total = device_buffers.widened(torch, x) * 3  # what NCCL's int32 sum of three ranks' x gives
    assert torch.equal(x.clone().copy_(total), x * 3)  # narrowed back: int16's own wrapped sum
    with pytest.raises(NotSupportedError, match="NCCL does not reduce bool tensors"):
        device_buffers.nccl_dtype(torch.zeros(1, dtype=torch.bool), "allreduce")


def test_fusion_pieces_start_on_16_byte_boundaries():
    assert device_buffers.aligned_offsets([3, 4, 1, 0, 5], 4) == ([0, 4, 8, 12, 12], 20)  # float32: 4 per 16 bytes
    assert device_buffers.aligned_offsets([3, 17], 8) == ([0, 4], 22)
    assert device_buffers.aligned_offsets([5, 5], 1) == ([0, 16], 32)
    assert device_buffers.aligned_offsets([], 2) == ([], 0)
