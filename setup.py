# SPDX-License-Identifier: Apache-2.0
# Metadata lives in pyproject.toml; this file names the cffi build of the C core, and ships the sources compiled on
# first use inside the package: the C sources of shmcomm.jax's XLA handler (shmcomm/jax/native.py compiles them
# against the jaxlib installed then) and the CUDA kernels (shmcomm/transport/cuda_kernels.py compiles them with
# nvcc where one exists). Nothing here runs nvcc: installs stay as fast without a GPU as with one.
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HANDLER_SOURCES = ("csrc/jax/handler.c", "csrc/jax/handler.h", "csrc/include/shmcomm.h")
CUDA_SOURCES = ("csrc/cuda/kernels.cu",)


class BuildPyWithHandler(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "shmcomm", "jax", "csrc")
        self.mkpath(target)
        for source in HANDLER_SOURCES:
            self.copy_file(source, os.path.join(target, os.path.basename(source)))
        target = os.path.join(self.build_lib, "shmcomm", "transport", "csrc")
        self.mkpath(target)
        for source in CUDA_SOURCES:
            self.copy_file(source, os.path.join(target, os.path.basename(source)))


setup(cffi_modules=["csrc/ffi_build.py:ffibuilder"], cmdclass={"build_py": BuildPyWithHandler})
