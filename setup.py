# SPDX-License-Identifier: Apache-2.0
# Metadata lives in pyproject.toml; this file names the cffi build of the C core, and ships the sources compiled on
# first use inside the package: the C sources of shmcomm.jax's XLA handler (shmcomm/jax/native.py compiles them
# against the jaxlib installed then), the cross-host rounds (shmcomm/transport/crossing.py compiles them with the MPI
# wheel's mpicc) and the CUDA kernels (shmcomm/transport/cuda_kernels.py compiles them with nvcc where one exists).
# Nothing here runs nvcc or mpicc: installs stay as fast without a GPU or MPI as with them.
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HANDLER_SOURCES = ("csrc/jax/handler.c", "csrc/jax/handler.h", "csrc/include/shmcomm.h")
TRANSPORT_SOURCES = ("csrc/cuda/kernels.cu", "csrc/mpi/crossing.c", "csrc/mpi/crossing.h", "csrc/include/shmcomm.h")


class BuildPyWithHandler(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "shmcomm", "jax", "csrc")
        self.mkpath(target)
        for source in HANDLER_SOURCES:
            self.copy_file(source, os.path.join(target, os.path.basename(source)))
        target = os.path.join(self.build_lib, "shmcomm", "transport", "csrc")
        self.mkpath(target)
        for source in TRANSPORT_SOURCES:
            self.copy_file(source, os.path.join(target, os.path.basename(source)))


setup(cffi_modules=["csrc/ffi_build.py:ffibuilder"], cmdclass={"build_py": BuildPyWithHandler})
