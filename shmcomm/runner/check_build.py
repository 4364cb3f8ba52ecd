# SPDX-License-Identifier: Apache-2.0
"""`shmcommrun --check-build`: what was built and what this machine offers, in Horovod's check-build layout.

Each probe answers (available, detail) and never raises: a broken optional package must show up as missing in
the report, not abort it.
"""

import ctypes
import ctypes.util
import glob
import importlib
import importlib.util
import os
import shutil
import sys


def _first_line(text):
    lines = str(text).strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


def _reason(error):
    return _first_line(f"{type(error).__name__}: {error}")


def _package_library(package, pattern):
    """A shared library shipped inside a pip package such as nvidia.nccl, without importing the package."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for directory in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(glob.glob(os.path.join(directory, "lib", pattern)))
        if found:
            return found[0]
    return None


def _library_version(path, function, decode):
    """Calls a library's `int f(int*)` version getter through ctypes; None when it cannot be loaded."""
    try:
        getter = getattr(ctypes.CDLL(path), function)
        value = ctypes.c_int(0)
        if getter(ctypes.byref(value)) != 0:
            return None
        return decode(value.value)
    except (OSError, AttributeError):
        return None


def probe_core():
    try:
        core = importlib.import_module("shmcomm._C")
    except Exception as error:  # an unbuilt core can fail in many ways; the report says which
        return False, f"NOT built ({_reason(error)})"
    return True, f"built ({getattr(core, '__file__', None) or 'built-in'})"


def _cuda_version(code):
    return f"{code // 1000}.{code % 1000 // 10}"


def probe_cuda():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path=os.path.join(cuda_home, "bin"))
    cudart = ctypes.util.find_library("cudart") or _package_library("nvidia.cuda_runtime", "libcudart.so*")
    if not nvcc and not cudart:
        return False, "not built (neither nvcc nor libcudart found)"
    parts = [f"nvcc {nvcc or 'not found'}", f"libcudart {cudart or 'not found'}"]
    version = cudart and _library_version(cudart, "cudaRuntimeGetVersion", _cuda_version)
    if version:
        parts.append(f"runtime {version}")
    return True, "found (" + ", ".join(parts) + ")"


def _nccl_version(code):
    if code >= 10000:  # NCCL 2.9 changed the encoding from major*1000 to major*10000
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def probe_nccl():
    library = ctypes.util.find_library("nccl") or _package_library("nvidia.nccl", "libnccl.so*")
    if not library:
        return False, "not found (no libnccl and no nvidia.nccl package)"
    version = _library_version(library, "ncclGetVersion", _nccl_version)
    return True, f"found ({library}" + (f", version {version})" if version else ", version unknown)")


def probe_mpi():
    try:
        import mpi4py
        mpi4py.rc.initialize = False  # the library version needs no MPI_Init, which can be slow or hang
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        return True, f"mpi4py {mpi4py.__version__}, {_first_line(MPI.Get_library_version())}"
    except Exception as error:
        return False, f"not available ({_reason(error)})"


def _probe_framework(module_name):
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        return False, f"not available ({_reason(error)})"
    return True, f"{module.__version__}"


def _shmcomm_version():
    try:
        from importlib.metadata import version
        return version("shmcomm")
    except Exception:
        pass
    try:
        return importlib.import_module("shmcomm").__version__
    except Exception:
        return "(version unknown)"


def _mark(available):
    return "[X]" if available else "[ ]"


def build_report():
    """The report as a list of lines."""
    core, cuda, nccl, mpi = probe_core(), probe_cuda(), probe_nccl(), probe_mpi()
    torch, jax = _probe_framework("torch"), _probe_framework("jax")
    version = _shmcomm_version()
    lines = [f"shmcomm {'v' + version if version[0].isdigit() else version}:", "", "Available Frameworks:"]
    lines += [f"    {_mark(torch[0])} PyTorch", f"    {_mark(jax[0])} JAX", ""]
    lines += ["Available Controllers/Transports:",
              f"    {_mark(core[0])} Shared memory (C core)",
              f"    {_mark(mpi[0])} MPI",
              f"    {_mark(cuda[0])} CUDA",
              f"    {_mark(nccl[0])} NCCL", ""]
    lines += ["Details:",
              f"    C core: {core[1]}",
              f"    CUDA: {cuda[1]}",
              f"    NCCL: {nccl[1]}",
              f"    MPI: {mpi[1]}",
              f"    PyTorch: {torch[1]}",
              f"    JAX: {jax[1]}"]
    return lines


def print_build_report():
    try:
        print("\n".join(build_report()), flush=True)
    except BrokenPipeError:  # `--check-build | head` is fine; keep Python from complaining at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
