# SPDX-License-Identifier: Apache-2.0
"""The XLA FFI handler of shmcomm.jax (csrc/jax/handler.c): built on first use, registered with XLA, and given this
process's context.

It is built on first use, not with the core, because it needs XLA's C API header, which ships with jaxlib: pip builds
shmcomm in an isolated environment without jax, and compiling against the jaxlib actually installed guarantees that
the handler speaks its API version. A machine without a C compiler can build it ahead, where one exists, with
`python -m shmcomm.jax.native` and the same SHMCOMM_BUILD_DIR. The core stays unchanged; the handler reaches its
collectives through function pointers that the shared-memory transport hands out."""
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from shmcomm.transport import build_cache

_MODULE = "_shmcomm_jax_ffi"
TARGET = "shmcomm_collective"


def _sources():
    """(handler dir, core include dir): inside the installed package (setup.py copies them there) or in the source
    tree of an editable install."""
    here = Path(__file__).resolve().parent
    for jax_dir, include in ((here / "csrc", here / "csrc"), (here.parents[1] / "csrc" / "jax",
                                                                here.parents[1] / "csrc" / "include")):
        if (jax_dir / "handler.c").exists() and (include / "shmcomm.h").exists():
            return jax_dir, include
    raise ImportError("shmcomm.jax: the handler's C sources are missing from the installation (%s)" % here)


def _cdef(jax_dir):
    lines = (jax_dir / "handler.h").read_text().splitlines()
    body = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    return ("typedef int... smc_result_t;\ntypedef int... smc_datatype_t;\ntypedef int... smc_redop_t;\n"
            "typedef struct smc_comm smc_comm_t;\n" + body +
            '\nextern "Python+C" int smc_jax_python(smc_jax_context_t*, smc_jax_call_t*);\n')


def build_dir():
    return build_cache.cache_dir("jax-ffi")


def _key(jax_dir, include, xla_include):
    digest = hashlib.sha256()
    for path in (jax_dir / "handler.c", jax_dir / "handler.h", include / "shmcomm.h",
                 Path(xla_include) / "xla" / "ffi" / "api" / "c_api.h"):
        digest.update(path.read_bytes())
    digest.update(sys.version.encode() + sysconfig.get_config_var("EXT_SUFFIX").encode())
    return digest.hexdigest()[:20]


def _compile(jax_dir, include, xla_include, work):
    """Compiles the module into the directory `work`."""
    from cffi import FFI

    builder = FFI()
    builder.cdef(_cdef(jax_dir))
    builder.set_source(_MODULE, '#include "handler.h"', sources=[str(jax_dir / "handler.c")],
                       include_dirs=[str(jax_dir), str(include), xla_include],
                       extra_compile_args=["-O2", "-std=gnu11", "-Wall"])
    try:
        built = Path(builder.compile(tmpdir=str(work.parent), verbose=False))
        os.replace(built, work / built.name)
    except Exception as error:
        raise ImportError("shmcomm.jax: could not compile the XLA FFI handler (a C compiler is needed once; "
                          "`python -m shmcomm.jax.native` builds it ahead): %s" % error) from error


def load():
    """The compiled module (ffi, lib), built first if needed: a small cffi module compiled into a cache directory
    (SHMCOMM_BUILD_DIR/jax-ffi, default ~/.cache/shmcomm/jax-ffi), keyed by the sources and jaxlib's header, under a
    file lock so that the ranks of a job build it once. Raises ImportError where it cannot be compiled."""
    import jax.ffi

    jax_dir, include = _sources()
    xla_include = jax.ffi.include_dir()
    target = build_cache.built(build_dir(), _key(jax_dir, include, xla_include),
                               lambda work: _compile(jax_dir, include, xla_include, work))
    module = build_cache.imported(target, _MODULE)
    return module.ffi, module.lib


if __name__ == "__main__":
    load()
    print("shmcomm.jax: the XLA FFI handler is built in %s" % build_dir())
