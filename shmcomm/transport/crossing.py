# SPDX-License-Identifier: Apache-2.0
"""The agreement's rounds across hosts in C (csrc/mpi/crossing.c), built on first use with the MPI wheel's mpicc.

A small cross-host collective is one MPI exchange per round, and the Python and mpi4py layers around each exchange
cost about as much as the exchange itself. So the module calls MPI directly on the communicator mpi4py holds
(mpi4py.MPI._addressof), and the core's smc_reduce by address; the core itself stays free of MPI. Where the module
cannot be built or loaded (load()), or with SHMCOMM_MPI_CROSSING=0, the agreement runs its rounds in Python, with
the same rules and the same deadline."""
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from shmcomm._native import lib as core_lib
from shmcomm.transport import build_cache
from shmcomm import env

log = logging.getLogger("shmcomm.transport")

_MODULE = "_shmcomm_crossing"
REDUCE_FAILED = core_lib.SMC_CROSSING_REDUCE_FAILED
# What a round does with its peer.
HAND_OVER, TAKE, SWAP, GIVE_BACK = (core_lib.SMC_ROUND_HAND_OVER, core_lib.SMC_ROUND_TAKE, core_lib.SMC_ROUND_SWAP,
                                    core_lib.SMC_ROUND_GIVE_BACK)
_loaded = None  # (ffi, lib), False when it cannot be had, None before the first try


def _sources():
    """The directories holding crossing.c and crossing.h, and the core's header they include: inside the installed
    package (setup.py copies all three there) or in the source tree of an editable install."""
    here = Path(__file__).resolve().parent
    for folder, include in ((here / "csrc", here / "csrc"),
                            (here.parents[1] / "csrc" / "mpi", here.parents[1] / "csrc" / "include")):
        if all((f / n).exists() for f, n in ((folder, "crossing.c"), (folder, "crossing.h"), (include, "shmcomm.h"))):
            return folder, include
    raise ImportError("the C sources of the cross-host rounds are missing from the installation (%s)" % here)


def _mpicc():
    beside = Path(sys.executable).parent / "mpicc"
    return str(beside) if beside.exists() else shutil.which("mpicc")


def _key(folder, include, mpicc):
    """The sources and the compiler wrapper itself (a script naming MPI's prefix and the compiler), read rather than
    run: every rank of a cross-host job computes this at start."""
    digest = hashlib.sha256()
    for path in (folder / "crossing.c", folder / "crossing.h", include / "shmcomm.h", Path(mpicc).resolve()):
        digest.update(path.read_bytes())
    digest.update((mpicc + sys.version + sysconfig.get_config_var("EXT_SUFFIX")).encode())
    return digest.hexdigest()[:20]


# Run in a process of its own whose CC is mpicc, so that the build has MPI's headers and library (the linker follows
# CC) without changing this process's environment.
_BUILD = """
import sys
from cffi import FFI
module, cdef, folder, include, tmpdir = sys.argv[1:]
builder = FFI()
builder.cdef(cdef)
builder.set_source(module, '#include "crossing.h"', sources=[folder + "/crossing.c"], include_dirs=[folder, include],
                   extra_compile_args=["-O2", "-std=gnu11", "-Wall"])
print(builder.compile(tmpdir=tmpdir, verbose=False))
"""


def _compile(folder, include, mpicc, work):
    lines = (folder / "crossing.h").read_text().splitlines()
    cdef = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    run = subprocess.run([sys.executable, "-c", _BUILD, _MODULE, cdef, str(folder), str(include), str(work.parent)],
                         env=dict(env.environment(), CC=mpicc), stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=600)
    if run.returncode != 0:
        raise ImportError("building the cross-host rounds with %s failed: %s" % (mpicc, run.stderr[-2000:]))
    built = Path(run.stdout.strip().splitlines()[-1])
    os.replace(built, work / built.name)


def _load():
    from mpi4py import MPI

    (folder, include), mpicc = _sources(), _mpicc()
    if mpicc is None:
        raise ImportError("no mpicc beside %s or on PATH" % sys.executable)
    target = build_cache.built(build_cache.cache_dir("crossing"), _key(folder, include, mpicc),
                               lambda work: _compile(folder, include, mpicc, work))
    module = build_cache.imported(target, _MODULE)
    text = module.ffi.new("char[]", 8192)
    module.lib.smc_crossing_library(text, 8192)
    built_for, running = module.ffi.string(text).decode(errors="replace"), MPI.Get_library_version()
    if built_for.strip() != running.strip():  # two MPI libraries in one process would not share a communicator
        raise ImportError("built for %r, but mpi4py runs %r" % (built_for.split("\n")[0], running.split("\n")[0]))
    return module.ffi, module.lib


def load():
    """(ffi, lib) of the compiled module, built first if needed; None where it cannot be had (said once, at debug
    level: the Python rounds are the fallback, not an error): no mpicc beside the interpreter or on PATH, no C
    compiler, or a module built for another MPI than the one mpi4py loaded. It is built like shmcomm.jax's handler,
    once per machine into a cache directory (SHMCOMM_BUILD_DIR/crossing, default ~/.cache/shmcomm/crossing), keyed by
    its sources and the compiler."""
    global _loaded
    if _loaded is None:
        if not env.mpi_crossing():
            _loaded = False
        else:
            try:
                _loaded = _load()
            except Exception as error:  # any reason at all: the Python rounds do the same work
                log.debug("cross-host rounds stay in Python: %s", error)
                _loaded = False
    return _loaded or None


def plan(fold_into, fold_from, partners):
    """[(peer, what the round does)] for agreement._schedule's answer."""
    if fold_into is not None:
        return [(fold_into, HAND_OVER)]
    return ([(fold_from, TAKE)] if fold_from is not None else []) + [(p, SWAP) for p in partners] + (
        [(fold_from, GIVE_BACK)] if fold_from is not None else [])


class Rounds:
    """The compiled rounds for one agreement over the MPI transport `transport` (transport.mpi.Mpi)."""

    def __init__(self, transport, rounds, message, incoming, capacity):
        from mpi4py import MPI

        from shmcomm._native import ffi as core_ffi, lib as core_lib

        self.ffi, self.lib = load()
        self.rounds = rounds
        self._comm = MPI._addressof(transport.comm)
        self._peers = self.ffi.new("int[]", [peer for peer, _ in rounds] or [0])
        self._kinds = self.ffi.new("int[]", [kind for _, kind in rounds] or [0])
        self._message, self._incoming, self._capacity = message, incoming, capacity
        self._reduce = int(core_ffi.cast("uintptr_t", core_ffi.addressof(core_lib, "smc_reduce")))
        self._late = self.ffi.new("int *")
        self._rank = transport.rank
        self._transport = transport

    def quick_call(self, world_size, min_bytes, max_bytes, usable):
        """These rounds as csrc/py/quick_crossing.h describes them, for the quick allreduce across hosts: a cffi
        smc_crossing_call_t of the core's, which keeps what it points to alive (its row fields are the caller's to
        fill). `usable`: the int flags of the transports that must not be broken (transport/mpi.py)."""
        from shmcomm._native import ffi as core_ffi

        def address(pointer):
            return int(self.ffi.cast("uintptr_t", pointer))
        call = core_ffi.new("smc_crossing_call_t *")
        call.rounds = address(self.ffi.addressof(self.lib, "smc_crossing_rounds"))
        call.mpi_comm = self._comm
        call.peers = core_ffi.cast("int *", address(self._peers))
        call.kinds = core_ffi.cast("int *", address(self._kinds))
        call.count, call.rank = len(self.rounds), self._rank
        call.message, call.incoming, call.capacity = self._message, self._incoming, self._capacity
        call.timeout_s = self._transport.timeout_s
        call.world_size, call.min_bytes, call.max_bytes = world_size, min_bytes, max_bytes
        call.usable = list(usable)
        self._quick_call = call  # with the arrays it points to, as long as these rounds live
        return call

    def late_peer(self, call):
        """The peer of the round that failed in a quick call (call.late_round)."""
        return self.rounds[call.late_round][0]

    def run(self, nbytes, count, code, op):
        """(0, None), or the failure: (-1, peer) after a wait ran out, (REDUCE_FAILED - core code, peer), or (MPI
        error, peer)."""
        rc = self.lib.smc_crossing_rounds(self._comm, self._peers, self._kinds, len(self.rounds), self._rank,
                                          self._message, self._incoming, self._capacity, nbytes, count, code, op,
                                          self._reduce, self._transport.timeout_s, self._late)
        return (0, None) if rc == 0 else (rc, self.rounds[self._late[0]][0])


def rounds_for(transport, fold_into, fold_from, partners, message, incoming, capacity):
    """A Rounds for an agreement over `transport`, or None: not the MPI transport, or no compiled module."""
    from shmcomm.transport.mpi import Mpi

    if not isinstance(transport, Mpi) or transport.size <= 1 or load() is None:
        return None
    return Rounds(transport, plan(fold_into, fold_from, partners), message, incoming, capacity)
