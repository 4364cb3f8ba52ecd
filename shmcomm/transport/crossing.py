# SPDX-License-Identifier: Apache-2.0
"""The agreement's rounds across hosts: the core's (csrc/coll/agreement.c), over MPI's exchanges in C
(csrc/mpi/crossing.c, built on first use with the MPI wheel's mpicc) or a Python transport's.

A small cross-host collective is one exchange per round, and the Python and mpi4py layers around each exchange cost
about as much as MPI's exchange itself. So the compiled module calls MPI directly on the communicator mpi4py holds
(mpi4py.MPI._addressof); the core itself stays free of MPI. Where the module cannot be built or loaded (load()), with
SHMCOMM_MPI_CROSSING=0, or over TCP, the rounds call the transport's exchange in Python instead."""
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from shmcomm._native import lib as core_lib
from shmcomm.transport import build_cache, memory
from shmcomm import env

log = logging.getLogger("shmcomm.transport")

_MODULE = "_shmcomm_crossing"
REDUCE_FAILED, EXCHANGE_LATE, EXCHANGE_RAISED = (core_lib.SMC_CROSSING_REDUCE_FAILED, core_lib.SMC_EXCHANGE_LATE,
                                                 core_lib.SMC_EXCHANGE_RAISED)
TAG = core_lib.SMC_AGREEMENT_TAG  # the agreement's messages, apart from the ring's on the same communicator
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
    level: the transport's exchange in Python is the fallback, not an error): no mpicc beside the interpreter or on
    PATH, no C compiler, or a module built for another MPI than the one mpi4py loaded. It is built like shmcomm.jax's
    handler, once per machine into a cache directory (SHMCOMM_BUILD_DIR/crossing, default ~/.cache/shmcomm/crossing),
    keyed by its sources and the compiler."""
    global _loaded
    if _loaded is None:
        if not env.mpi_crossing():
            _loaded = False
        else:
            try:
                _loaded = _load()
            except Exception as error:  # any reason at all: the exchanges in Python do the same work
                log.debug("cross-host exchanges stay in Python: %s", error)
                _loaded = False
    return _loaded or None


def plan(fold_into, fold_from, partners):
    """[(peer, what the round does)] for agreement._schedule's answer."""
    if fold_into is not None:
        return [(fold_into, HAND_OVER)]
    return ([(fold_from, TAKE)] if fold_from is not None else []) + [(p, SWAP) for p in partners] + (
        [(fold_from, GIVE_BACK)] if fold_from is not None else [])


class Rounds:
    """The agreement's rounds (the core's smc_agreement_rounds, csrc/coll/agreement.c) for one agreement over
    `transport`: each exchange in C over MPI (smc_crossing_exchange) where the transport is MPI and the compiled module
    can be had (load()), else the transport's own exchange (PointToPoint.exchange), called back in Python.
    `message` and `incoming`: the agreement's buffers (a header, then `capacity` bytes); late(peer): the error of a
    peer that did not come in time."""

    def __init__(self, transport, rounds, message, incoming, capacity, late):
        from shmcomm._native import ffi as core_ffi
        from shmcomm.transport.mpi import Mpi

        self.rounds, self.late = rounds, late
        self._peers = core_ffi.new("int[]", [peer for peer, _ in rounds] or [0])
        self._kinds = core_ffi.new("int[]", [kind for _, kind in rounds] or [0])
        self._message, self._incoming, self._capacity = message, incoming, capacity
        self._late = core_ffi.new("int *")
        self._rank = transport.rank
        self._transport = transport
        self.raised = None  # what the transport's exchange raised, for rounds that returned EXCHANGE_RAISED
        self.module = load() if isinstance(transport, Mpi) and transport.size > 1 else None
        if self.module is not None:
            from mpi4py import MPI

            ffi, lib = self.module
            self._exchange = core_ffi.cast("smc_exchange_fn", int(ffi.cast("uintptr_t", ffi.addressof(
                lib, "smc_crossing_exchange"))))
            self._context = core_ffi.cast("void *", MPI._addressof(transport.comm))
        else:
            self._exchange = core_lib.smc_python_exchange
            self._context = self._handle = core_ffi.new_handle(self)

    def run(self, nbytes, count, code, op):
        """(0, None), or the failure: (EXCHANGE_LATE, peer) after a wait ran out, (EXCHANGE_RAISED, peer) when the
        transport raised (`raised`), (REDUCE_FAILED - core code, peer), or (MPI's error, peer)."""
        self.raised = None
        rc = core_lib.smc_agreement_rounds(self._exchange, self._context, self._peers, self._kinds, len(self.rounds),
                                           self._rank, self._message, self._incoming, self._capacity, nbytes, count,
                                           code, op, self._transport.timeout_s, self._late)
        return (0, None) if rc == 0 else (rc, self.rounds[self._late[0]][0])

    def exchange(self, peer, into, into_len, out, out_len, deadline):
        """One round's exchange through the transport (PointToPoint.exchange), for the core's rounds."""
        send = memory.view(out, out_len) if out_len >= 0 else None
        receive = memory.view(into, into_len) if into != memory.NULL else None
        self._transport.exchange(peer, send, max(out_len, 0), receive, deadline, TAG, lambda: self.late(peer))

    def quick_call(self, world_size, usable, row, world_rank):
        """(call, allreduce): these rounds as csrc/py/quick_crossing.h describes them, a cffi smc_crossing_call_t of
        the core's that keeps what it points to alive, and the quick allreduce across hosts bound to it,
        allreduce(x, out, op, prescale, postscale), or None where this build has none. Only rounds over the compiled
        module have one. `usable`: the int flags of the transports that must not be broken (transport/mpi.py); `row`:
        the host's SharedMemory transport. The sizes it takes (min_bytes, max_bytes) are 0 until the caller sets
        them."""
        from shmcomm._native import ffi as core_ffi, quick_function

        if self.module is None:
            return None
        call = core_ffi.new("smc_crossing_call_t *")
        call.exchange = int(core_ffi.cast("uintptr_t", self._exchange))
        call.context = int(core_ffi.cast("uintptr_t", self._context))
        call.peers, call.kinds = self._peers, self._kinds
        call.count, call.rank = len(self.rounds), self._rank
        call.message, call.incoming, call.capacity = self._message, self._incoming, self._capacity
        call.timeout_s = self._transport.timeout_s
        call.world_size, call.min_bytes, call.max_bytes = world_size, 0, 0
        call.usable = list(usable)
        call.row, call.row_rank, call.row_size, call.world_rank = row.address, row.rank, row.size, world_rank
        self._quick_call = call  # as long as these rounds live
        return call, quick_function(5, [int(core_ffi.cast("uintptr_t", call))])

    def late_peer(self, call):
        """The peer of the round that failed in a quick call (call.late_round)."""
        return self.rounds[call.late_round][0]


def _python_exchange():
    """The core's callback for rounds whose exchanges Python's transports make (Rounds.exchange): an exception stops
    the rounds, and Rounds keeps it for the caller to raise."""
    from shmcomm._native import ffi as core_ffi

    @core_ffi.def_extern(name="smc_python_exchange", error=EXCHANGE_RAISED)
    def exchange(context, peer, into, into_len, out, out_len, deadline):
        rounds = core_ffi.from_handle(context)
        try:
            rounds.exchange(peer, into, into_len, out, out_len, deadline)
        except BaseException as error:  # a timeout, a lost peer, MPI's error, or Ctrl-C: raised after the rounds
            rounds.raised = error
            return EXCHANGE_RAISED
        return 0


_python_exchange()
