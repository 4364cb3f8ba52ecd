# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels of csrc/cuda/kernels.cu (scaling, batched copies for fusion), compiled with nvcc on first use.

Only what torch does not already do in one kernel: unpacking a fusion buffer into N tensors is N copy kernels in
torch and one launch here (per 64 tensors); the scaling computes 16-bit floats in float32 in the same pass. They are
compiled on first use, not at install, because most machines that install shmcomm have no nvcc and the GPU to compile
for is known only where the kernels run. Without nvcc, `load()` returns None and callers use torch's own operations
for the same steps; `unavailable()` says why. Loading launches one empty kernel, so that a driver that cannot run them
(none, or older than the toolkit) sends callers to torch's operations once, instead of failing every collective."""
import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from shmcomm.transport import build_cache
from shmcomm import env

ABI_VERSION = 3
LIBRARY = "libshmcomm_cuda.so"
# The dtype codes of the kernels, which are the C core's (smc_datatype_t) for the floating types.
DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
_loaded = {}  # archs -> Kernels or None
_why_not = {}


def source():
    """csrc/cuda/kernels.cu: inside the installed package (setup.py copies it there) or in the source tree."""
    here = Path(__file__).resolve().parent
    for path in (here / "csrc" / "kernels.cu", here.parents[1] / "csrc" / "cuda" / "kernels.cu"):
        if path.exists():
            return path
    return None


def nvcc():
    """The nvcc to use: $CUDA_HOME/bin/nvcc, else the one on PATH; None without one."""
    home = env.cuda_home()
    if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def archs(capability=None):
    """The architectures to compile for, as numbers ("90"): SHMCOMM_CUDA_ARCHS (e.g. "90" or "80;90"), else
    `capability` (major, minor), else 75 (the oldest CUDA 13 supports, as PTX that newer GPUs compile when they load
    it)."""
    chosen = env.cuda_archs()
    if chosen:
        return chosen
    if capability is not None:
        return ["%d%d" % tuple(capability)]
    return ["75"]


def command(compiler, src, out, arch_list):
    """nvcc's command line: SASS for each architecture and PTX for the first, so that newer GPUs can JIT it. The
    runtime is linked statically (-cudart static), so the library needs only the driver."""
    gencode = ["-gencode=arch=compute_%s,code=sm_%s" % (a, a) for a in arch_list]
    gencode.append("-gencode=arch=compute_%s,code=compute_%s" % (arch_list[0], arch_list[0]))
    return [compiler, "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", *gencode, "-o", str(out),
            str(src)]


def _key(compiler, src, arch_list):
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256(src.read_bytes() + version.encode() + ";".join(arch_list).encode())
    return digest.hexdigest()[:20]


def build(arch_list):
    """The path of the compiled library (building it if needed). Raises RuntimeError with nvcc's words when the
    compilation fails, FileNotFoundError without nvcc or the source. It is built into SHMCOMM_BUILD_DIR/cuda-kernels
    (default ~/.cache/shmcomm/cuda-kernels), keyed by the source, nvcc's version and the target architectures, under
    the lock of build_cache.py so that a job's ranks build once."""
    compiler, src = nvcc(), source()
    if compiler is None:
        raise FileNotFoundError("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    if src is None:
        raise FileNotFoundError("csrc/cuda/kernels.cu is missing from the installation")

    def compile_into(work):
        done = subprocess.run(command(compiler, src, work / LIBRARY, arch_list), capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError("nvcc failed (%s): %s" % (" ".join(command(compiler, src, LIBRARY, arch_list)),
                                                         done.stderr.strip()[-2000:]))

    root = build_cache.cache_dir("cuda-kernels")
    return build_cache.built(root, _key(compiler, src, arch_list), compile_into) / LIBRARY


class Kernels:
    """The loaded library. Each call enqueues on `stream` (a CUDA stream handle, an int) and raises RuntimeError
    with the CUDA error code if the launch failed."""

    def __init__(self, path):
        self.path = str(path)
        self.library = ctypes.CDLL(self.path)
        c = ctypes
        self.library.smc_cuda_abi_version.restype = c.c_int
        version = self.library.smc_cuda_abi_version()
        if version != ABI_VERSION:
            raise RuntimeError("%s has interface version %d, expected %d" % (path, version, ABI_VERSION))
        self.library.smc_cuda_probe.restype = c.c_int
        self._check(self.library.smc_cuda_probe(), "probe")
        self.library.smc_cuda_scale.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_double, c.c_void_p]
        self.library.smc_cuda_copy_batch.argtypes = [c.POINTER(c.c_void_p), c.POINTER(c.c_void_p),
                                                     c.POINTER(c.c_size_t), c.c_int, c.c_void_p]

    def scale(self, ptr, count, dtype, factor, stream):
        """x = factor * x in place; `dtype` one of DTYPES."""
        self._check(self.library.smc_cuda_scale(ptr, count, DTYPES[dtype], float(factor), stream), "scale")

    def copy_batch(self, copies, stream):
        """[(src, dst, nbytes)] of device pointers, in as few launches as the kernel's batch allows."""
        n = len(copies)
        if n == 0:
            return
        srcs = (ctypes.c_void_p * n)(*[c[0] for c in copies])
        dsts = (ctypes.c_void_p * n)(*[c[1] for c in copies])
        sizes = (ctypes.c_size_t * n)(*[c[2] for c in copies])
        self._check(self.library.smc_cuda_copy_batch(srcs, dsts, sizes, n, stream), "copy_batch")

    @staticmethod
    def _check(code, what):
        if code != 0:
            raise RuntimeError("shmcomm CUDA kernel %s failed to launch (CUDA error %d%s)"
                               % (what, code, ": the driver is missing or older than the toolkit" if code in (35, 100)
                                  else ""))


def load(capability=None):
    """The kernels for the device of compute capability `capability`, or None when they cannot be built here (no
    nvcc, a failed build): callers then use torch's operations, and unavailable() says why."""
    arch_list = tuple(archs(capability))
    if arch_list not in _loaded:
        try:
            _loaded[arch_list] = Kernels(build(list(arch_list)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _loaded[arch_list], _why_not[arch_list] = None, str(error)
    return _loaded[arch_list]


def unavailable(capability=None):
    """Why load(capability) returned None, or None if it did not."""
    return _why_not.get(tuple(archs(capability)))
