# SPDX-License-Identifier: Apache-2.0
"""`shmcommrun --check-build`: what shmcomm can do here, in Horovod's check-build layout.

As in Horovod, [X] means "usable through this library", not "installed": CUDA needs a torch that sees a GPU, NCCL
needs that and a libnccl shmcomm can load, and JAX needs what shmcomm.jax builds on (jax.ffi and XLA's C API header
from jaxlib, and optax). Each probe answers (usable, detail) and never raises: a broken optional
package must show up as unusable in the report, not abort it.
"""

import importlib
import os
import sys

from .mpi_launch import find_mpiexec

def _first_line(text):
    lines = str(text).strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


def _reason(error):
    return _first_line(f"{type(error).__name__}: {error}")


def probe_core():
    try:
        core = importlib.import_module("shmcomm._C")
    except Exception as error:  # an unbuilt core can fail in many ways; the report says which
        return False, f"NOT built ({_reason(error)})"
    return True, f"built ({getattr(core, '__file__', None) or 'built-in'})"


def probe_mpi():
    """Usable when mpi4py loads its MPI library and there is an mpiexec to start a job across hosts."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False  # the library version needs no MPI_Init, which can be slow or hang
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        library = f"mpi4py {mpi4py.__version__}, {_first_line(MPI.Get_library_version())}"
    except Exception as error:
        return False, f"not available ({_reason(error)})"
    mpiexec = find_mpiexec()
    if not mpiexec:
        return False, f"{library}, but no mpiexec beside {sys.executable} or on PATH"
    return True, f"{library}, {mpiexec}"


def probe_torch():
    try:
        import torch
    except Exception as error:
        return False, f"not available ({_reason(error)})"
    # shmcomm.torch's DistributedOptimizer hooks each gradient with this (torch 2.1 and later).
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        return False, f"{torch.__version__} is too old: shmcomm.torch needs torch 2.1 or later"
    return True, torch.__version__


def probe_cuda():
    """Usable when torch sees a GPU: CUDA tensors then go through shmcomm.torch. The detail says whether nvcc is
    there to build the CUDA kernels on first use (torch's own operations stand in for them otherwise)."""
    try:
        import torch
        from shmcomm.transport import cuda_kernels
        available = torch.cuda.is_available()
        kernels = (f"kernels: built with {cuda_kernels.nvcc()} on first use" if cuda_kernels.nvcc() else
                   "kernels: no nvcc, torch's operations stand in")
    except Exception as error:
        return False, f"not available ({_reason(error)})"
    if not available:
        return False, f"torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False); {kernels}"
    return True, (f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s); "
                  f"{kernels}")


def probe_nccl(cuda):
    """Which libnccl shmcomm would load at run time, and its version; usable with CUDA tensors (`cuda`: the CUDA
    probe's answer)."""
    try:
        from shmcomm.transport import nccl_library
        library = nccl_library.load()
    except Exception as error:
        return False, f"library: {_reason(error)}"
    found = f"library: NCCL {library.version_text} at {library.path} (from {library.found_by})"
    return (True, found) if cuda[0] else (False, f"no GPU to use it on; {found}")


def probe_jax():
    """Usable when jax offers the FFI that shmcomm.jax's handler is compiled against, and optax is there."""
    try:
        import jax
        import jax.ffi
        import optax
    except Exception as error:
        return False, f"not available ({_reason(error)})"
    header = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    if not os.path.exists(header):
        return False, f"jax {jax.__version__}, but jaxlib has no {header}"
    return True, f"jax {jax.__version__}, optax {optax.__version__}"


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


def _mark(usable):
    return "[X]" if usable else "[ ]"


def build_report():
    """The report as a list of lines."""
    core, mpi, torch, jax, cuda = probe_core(), probe_mpi(), probe_torch(), probe_jax(), probe_cuda()
    nccl = probe_nccl(cuda)
    rows = {
        "Available Frameworks:": [("PyTorch", torch), ("JAX", jax)],
        "Available Controllers/Transports:": [("Shared memory", core), ("MPI", mpi)],
        "Available Tensor Operations:": [("NCCL", nccl), ("CUDA", cuda), ("C core (CPU)", core)],
    }
    version = _shmcomm_version()
    lines = [f"shmcomm {'v' + version if version[0].isdigit() else version}:", ""]
    for heading, entries in rows.items():
        lines += [heading] + [f"    {_mark(usable)} {name}" for name, (usable, _) in entries] + [""]
    details = {"C core": core, "MPI": mpi, "PyTorch": torch, "JAX": jax, "CUDA": cuda, "NCCL": nccl}
    return lines + ["Details:"] + [f"    {name}: {detail}" for name, (_, detail) in details.items()]


def print_build_report():
    try:
        print("\n".join(build_report()), flush=True)
    except BrokenPipeError:  # `--check-build | head` is fine; keep Python from complaining at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
