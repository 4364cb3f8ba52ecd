# SPDX-License-Identifier: Apache-2.0
"""Builds the C core into ``shmcomm._C`` with cffi in API mode.

The cdef is the public header itself, minus preprocessor lines, so the declarations Python sees are checked by the C
compiler against the code they describe."""
import glob
import os
import platform

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "include", "shmcomm.h")


def _cdef_text():
    with open(HEADER) as f:
        return "".join(line for line in f if not line.lstrip().startswith("#"))


def _sources():
    found = sorted(p for p in glob.glob(os.path.join(HERE, "*", "*.c")) if os.path.basename(os.path.dirname(p)) != "jax")
    # setuptools wants sources relative to where the build runs.
    return [os.path.relpath(p) for p in found]


def core_flags():
    """The flags of csrc/cflags.txt, which says why each is there: the first word of every line starting with '-'."""
    with open(os.path.join(HERE, "cflags.txt")) as f:
        return [line.split()[0] for line in f if line.startswith("-")]


def _compile_args():
    args = core_flags()
    if os.environ.get("SHMCOMM_SANITIZE"):
        args += ["-fsanitize=" + os.environ["SHMCOMM_SANITIZE"], "-fno-omit-frame-pointer", "-O1", "-g"]
    return args


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.set_source(
    "shmcomm._C",
    '#include "shmcomm.h"',
    sources=_sources(),
    include_dirs=[os.path.relpath(os.path.join(HERE, "include")), os.path.relpath(HERE)],
    extra_compile_args=_compile_args(),
    extra_link_args=["-pthread"] + (["-fsanitize=" + os.environ["SHMCOMM_SANITIZE"]]
                                    if os.environ.get("SHMCOMM_SANITIZE") else []),
    libraries=["rt"] if platform.system() == "Linux" else [],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
