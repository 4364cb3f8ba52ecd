# SPDX-License-Identifier: Apache-2.0
"""Builds the C core into ``shmcomm._C`` with cffi in API mode.

The cdef is the public header itself, minus preprocessor lines, so the declarations Python sees are checked by the C
compiler against the code they describe."""
import glob
import os
import platform
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "include", "shmcomm.h")


def _cdef_text(header=HEADER):
    """The header's declarations for cffi: its lines that are not preprocessor directives, and each constant
    `#define SMC_NAME value` as cffi reads one from the compiled C (an integer, a double or a string), so that Python
    takes its value from the header and never a copy."""
    lines = []
    with open(header) as f:
        for line in f:
            words = line.split(None, 2)
            if not line.lstrip().startswith("#"):
                lines.append(line)
            elif len(words) == 3 and words[0] == "#define" and words[1].startswith("SMC_") and "(" not in words[1]:
                value = words[2].split("/*")[0].strip()
                if value.startswith('"'):
                    lines.append("static char *const %s;\n" % words[1])
                elif re.fullmatch(r"[0-9]*\.?[0-9]+[eE][+-]?[0-9]+|[0-9]*\.[0-9]+", value):
                    lines.append("static const double %s;\n" % words[1])
                else:
                    lines.append("#define %s ...\n" % words[1])
    return "".join(lines)


# Not the core: shmcomm.jax's XLA handler and the cross-host rounds over MPI (each built apart, on first use) and the
# CPython functions compiled into this module only.
APART = ("jax", "mpi", "py")


def _sources():
    found = sorted(p for p in glob.glob(os.path.join(HERE, "*", "*.c"))
                   if os.path.basename(os.path.dirname(p)) not in APART)
    # setuptools wants sources relative to where the build runs.
    return [os.path.relpath(p) for p in found]


def _depends():
    """Every header and every included C file (csrc/py/*.c) the core's sources and the cffi module read: setuptools
    rebuilds the core when any of them is newer than it, not only when a compiled source is."""
    found = glob.glob(os.path.join(HERE, "**", "*.[ch]"), recursive=True) + [os.path.join(HERE, "cflags.txt")]
    return sorted(os.path.relpath(p) for p in found if os.path.relpath(p, HERE).split(os.sep)[0] not in ("jax", "mpi"))


def core_flags():
    """The flags of csrc/cflags.txt, which says why each is there: the first word of every line starting with '-'."""
    with open(os.path.join(HERE, "cflags.txt")) as f:
        return [line.split()[0] for line in f if line.startswith("-")]


def _compile_args():
    args = core_flags()
    if os.environ.get("SHMCOMM_SANITIZE"):
        args += ["-fsanitize=" + os.environ["SHMCOMM_SANITIZE"], "-fno-omit-frame-pointer", "-O1", "-g"]
    return args


def _limited_api():
    """csrc/py/quick_calls.c uses the buffer protocol, in the limited API from Python 3.11 (cffi would otherwise
    declare the oldest one); on older Pythons it compiles to nothing and the collectives keep to their Python path."""
    return [("Py_LIMITED_API", "0x030B0000")] if sys.version_info >= (3, 11) and not hasattr(sys, "gettotalrefcount") \
        else []


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.cdef("void* smc_quick_method(int which);")  # csrc/py/quick_calls.c: a PyMethodDef, or NULL
ffibuilder.cdef(_cdef_text(os.path.join(HERE, "py", "quick_crossing.h")))  # what its cross-host allreduce reads
ffibuilder.cdef(_cdef_text(os.path.join(HERE, "net", "handshake.h")))  # for shmcomm/transport/handshake.py
# The agreement's exchange through a Python transport (shmcomm/transport/crossing.py), an smc_exchange_fn.
ffibuilder.cdef('extern "Python" int smc_python_exchange(void* context, int peer, void* into, int into_len, '
                'const void* out, int out_len, double deadline);')
ffibuilder.set_source(
    "shmcomm._C",
    '#include <string.h>\n#include "shmcomm.h"\n#include "net/handshake.h"\n#include "py/quick_crossing.h"\n'
    '#include "py/quick_calls.c"',
    sources=_sources(),
    depends=_depends(),
    define_macros=_limited_api(),
    include_dirs=[os.path.relpath(os.path.join(HERE, "include")), os.path.relpath(HERE)],
    extra_compile_args=_compile_args(),
    extra_link_args=["-pthread"] + (["-fsanitize=" + os.environ["SHMCOMM_SANITIZE"]]
                                    if os.environ.get("SHMCOMM_SANITIZE") else []),
    libraries=["rt"] if platform.system() == "Linux" else [],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
