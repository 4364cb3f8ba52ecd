# SPDX-License-Identifier: Apache-2.0
# Metadata lives in pyproject.toml; this file only names the cffi build of the C core.
from setuptools import setup

setup(cffi_modules=["csrc/ffi_build.py:ffibuilder"])
