# SPDX-License-Identifier: Apache-2.0
"""This process's side of the XLA handler: the context every executable points at, kept in step with the session,
and what the handler asks of Python.

The handler calls the C core itself only while the world communicator is one host's shared memory and no engine runs
(direct()); otherwise it hands each call to Python, which runs it through engine.calls.run as the numpy API does, so
that asynchronous numpy or torch collectives and the jitted ones keep one order on every rank. The numpy API's blocking
calls wait for shmcomm.jax.jit's programs in flight themselves (sealed.py); after plain jax.jit's, a program that
mixes them calls jax.effects_barrier() first."""
import collections
import itertools
import math
import os
import threading

import numpy as np

from shmcomm.vocabulary import description, dtypes
from shmcomm import env
from shmcomm.startup import log, session
from shmcomm._native import error_for
from shmcomm.algorithms.host import HostComm
from shmcomm.vocabulary.buffers import wrap
from shmcomm.engine.calls import run
from shmcomm.engine.request import Request
from shmcomm.vocabulary.exceptions import MismatchError, NotInitializedError, ShmCommError
from shmcomm.jax import native, results_heap
from shmcomm.vocabulary.ops import ReduceOp
from shmcomm.quick_path import host_alone, world

ffi, lib = native.load()
_context = ffi.new("smc_jax_context_t *")  # lives as long as the process: executables hold its address
_context.pid = os.getpid()
_context.max_ranks = 1 << 16


def huge_page_size(root="/sys/kernel/mm/transparent_hugepage"):
    """The transparent huge page size the kernel grants on request (madvise), in bytes; 0 where it grants none (no
    THP, mode "never", or an unreadable or odd value). The handler asks for it on large results."""
    try:
        with open(os.path.join(root, "enabled")) as f:
            if "[never]" in f.read():
                return 0
        with open(os.path.join(root, "hpage_pmd_size")) as f:
            size = int(f.read().strip())
    except (OSError, ValueError):
        return 0
    return size if size > 0 and size & (size - 1) == 0 else 0


_context.huge_page = huge_page_size()
results_heap.keep_results_mapped(env.jax_heap_bytes())
_lock = threading.Lock()


def address():
    return int(ffi.cast("intptr_t", _context))


def _register():
    import jax.ffi

    capsule = jax.ffi.pycapsule(int(ffi.cast("intptr_t", lib.shmcomm_jax_handler_address())))
    jax.ffi.register_ffi_target(native.TARGET, capsule, platform="cpu")


_register()


def sync():
    """Points the context at the session's host segment when the handler may call the core itself; at nothing
    otherwise. Runs on every init, shutdown, and start or stop of the engine."""
    comm = host_alone()
    with _lock:
        if comm is not None:
            handle, entry = comm.shm.native_entry_points()
            core = _context.core
            for name, addr in entry.items():
                setattr(core, name, ffi.cast(ffi.typeof(getattr(core, name)), addr))
            _context.comm = ffi.cast("smc_comm_t *", handle)
        else:
            _context.comm = ffi.NULL


def direct():
    """Whether the handler calls the C core itself now (one host, no engine), rather than Python. That path runs on
    XLA's thread, which JAX lets run ahead of Python (asynchronous dispatch): jitted collectives are ordered among
    themselves by their token, but not against the numpy API's blocking calls, which go straight to the segment from
    the caller's thread."""
    return _context.comm != ffi.NULL


session.on_change(sync)
sync()


def finish_in_flight():
    """Waits for the jitted collectives still running: JAX returns from a jitted call before it has run, and a
    program may end, or shut shmcomm down, right after one. Without the wait the handler would find the communicator
    closed (or its segment unmapped) under it. A failure there was the program's to see; it is logged, not raised,
    as the program is leaving."""
    import jax

    try:
        jax.effects_barrier()
    except Exception as error:
        log.logger.warning("a collective still running at shutdown failed: %s", error)


session.on_close(finish_in_flight)  # shutdown(), the program's or the one at exit


# ---- failures as the caller sees them ----
_raised = collections.OrderedDict()  # id -> exception, the latest few, for `original`
_ids = itertools.count(1)
_MARK = "(shmcomm error #"


def _recorded(error):
    """The text the handler returns to XLA for `error`, remembered so that `original` finds the exception."""
    number = next(_ids)
    with _lock:
        _raised[number] = error
        while len(_raised) > 64:
            _raised.popitem(last=False)
    return "%s %s%d): %s" % (type(error).__name__, _MARK, number, error)


def original(error):
    """The shmcomm exception behind a JaxRuntimeError that a collective raised under jit.

    Eager calls raise the shmcomm exception directly; under jit, XLA wraps it.

    Args:
        error: a jax.errors.JaxRuntimeError.

    Returns:
        The shmcomm exception (MismatchError, RankFailure...), or None when the error did not come from a collective.

    Example:
            try:
                step(params, batch)
            except jax.errors.JaxRuntimeError as error:
                cause = sj.original(error)
                if isinstance(cause, sj.MismatchError):
                    ...
    """
    text = str(error)
    at = text.find(_MARK)
    if at < 0:
        return None
    digits = text[at + len(_MARK):].split(")", 1)[0]
    return _raised.get(int(digits)) if digits.isdigit() else None


# ---- the handler's calls into Python ----
_handling = threading.local()


def in_handler():
    """Whether this thread is XLA's, running the handler's Python path."""
    return getattr(_handling, "active", False)


@ffi.def_extern(name="smc_jax_python", error=1)
def _from_handler(ctx, call):
    """Runs `call` (rc == 0) or explains the core's failure (rc != 0); returns 0 on success, else 1 with the text in
    call.error. Never raises: the handler is C code under XLA.

    Calls come here when the context's `comm` is NULL: across hosts they run on the torus and the MPI transport, and
    with the engine running through the engine's queue. A small allreduce across hosts without the engine takes the
    numpy API's quick call (quick_path.world.crossing_allreduce: the torus's small path in one C call) before a
    Request would be built. A failed direct call comes here too, for the numpy API's explanation of the failure."""
    _handling.active = True
    try:
        if call.rc:
            error = _explained(call)
        else:
            _execute(call)
            return 0
    except ShmCommError as failure:
        error = failure
    except Exception as failure:  # a bug here must still fail the collective, with its text
        error = ShmCommError("%s: %s: %s" % (_name(call), type(failure).__name__, failure))
    finally:
        _handling.active = False
    text = _recorded(error).encode("utf-8", "replace")[:ffi.sizeof(call.error) - 1]
    ffi.memmove(call.error, text + b"\0", len(text) + 1)
    return 1


def _name(call):
    return ffi.unpack(call.name, call.name_len).decode("utf-8", "replace")


def _view(ptr, nbytes, code, dims):
    """A numpy array over XLA's buffer: of the core's type `code`, or bytes for types the core does not reduce."""
    raw = np.frombuffer(ffi.buffer(ptr, nbytes), dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)
    if code < 0:
        rows = dims[0] if dims else 1
        return raw.reshape(rows, -1) if rows else raw.reshape(0, 0)
    return raw.view(dtypes.numpy_dtype(code)).reshape(dims)


_REDUCTIONS = ("allreduce", "reducescatter")


def _execute(call):
    """The handler's call as the one Request the numpy API would build, run by engine.calls.run. Allreduce and
    broadcast write into XLA's result buffer; the others' results are copied there (their shapes were fixed at
    compile time, and a mismatch raises)."""
    comm = session.state.comm
    what, kind = _name(call), description.KIND_NAME.get(call.kind)
    if comm is None:
        raise NotInitializedError("%s: shmcomm is not initialized (shmcomm.jax.init())" % what)
    if kind is None:
        raise ShmCommError("%s: unknown collective kind %d" % (what, call.kind))
    if kind == "barrier":
        run(Request("barrier", None, None, comm, 0))
        return
    dims = [int(call.src_dims[d]) for d in range(call.src_ndim)]
    src = _view(call.src, call.src_bytes, call.dtype, dims)
    in_place = kind in ("allreduce", "broadcast")
    dst = _view(call.dst, call.dst_bytes, call.dtype, dims) if in_place else None
    if kind == "allreduce" and world.jitted_crossing:  # NotImplemented: nothing was sent, the Request decides
        got = world.jitted_crossing(src, dst, call.op, call.prescale, call.postscale)
        if got is not NotImplemented:
            if type(got) is not np.ndarray:
                world.comm.quick_allreduce_failed(got, src, call.op, call.prescale, call.postscale, what)
            return
    rows = [int(call.rows[r]) for r in range(call.nranks)] if call.rows != ffi.NULL else None
    sends = [int(call.sends[r]) for r in range(call.nranks)] if kind == "alltoall" else None
    # Equal blocks travel as one row per rank: the agreement then also checks that every rank has the rows this
    # rank's executable expects.
    blocks = kind == "allgather" and len(set(rows)) == 1 or kind == "alltoall" and len(set(sends)) == 1 and \
        sends == rows
    tensor = src.reshape(comm.size if kind == "alltoall" else 1, -1) if blocks else src
    result = run(Request(kind, what, tensor, comm, 0, output=dst, op=ReduceOp(call.op) if kind in _REDUCTIONS else None,
                         prescale=call.prescale, postscale=call.postscale, root=call.root,
                         splits=([1] * comm.size if blocks else sends) if kind == "alltoall" else None))
    if kind == "alltoall":
        result, got = result
        if not blocks and [int(g) for g in got] != rows:
            raise MismatchError("%s: received rows %s, expected %s" % (what, list(got), rows), "count")
    if not in_place:
        _copy(result, call, what)


def _copy(out, call, what):
    flat = np.ascontiguousarray(out).reshape(-1).view(np.uint8)
    if flat.nbytes != call.dst_bytes:
        raise MismatchError("%s: ranks disagree on the tensor: %d bytes arrived, %d expected" % (
            what, flat.nbytes, call.dst_bytes), "shape")
    if flat.nbytes:
        ffi.memmove(call.dst, ffi.from_buffer(flat), flat.nbytes)


def _explained(call):
    """The exception for the core's failure, as the numpy API raises it (every rank's shape for a shape mismatch:
    every rank of a mismatch lands here together)."""
    what = _name(call)
    error = error_for(call.rc, what)
    comm = session.state.comm
    if isinstance(error, MismatchError) and isinstance(comm, HostComm) and call.src != ffi.NULL and call.dtype >= 0:
        dims = [int(call.src_dims[d]) for d in range(call.src_ndim)]
        if call.src_bytes == math.prod(dims) * np.dtype(dtypes.numpy_dtype(call.dtype)).itemsize:
            error = comm.explain_mismatch(error, what, wrap(_view(call.src, call.src_bytes, call.dtype, dims), what))
    return error
