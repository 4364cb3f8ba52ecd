# SPDX-License-Identifier: Apache-2.0
"""The reference every collective is held against: one process copying a buffer into another (np.copyto), and
two processes copying at once, which is what two ranks sharing the memory system can hope for together."""
import multiprocessing
import time

import numpy as np

from benchmarks.backends import Unsupported

REFERENCE_BYTES = 64 << 20
REFERENCE_ITERS = 10


class MemcpyBackend:
    name = "memcpy"
    call_errors = ()
    rank, size = 0, 1

    def __init__(self, **_options):
        self.library = "numpy %s copyto" % np.__version__

    def barrier(self):
        pass

    def combine(self, values, how):
        return np.asarray(values, dtype=np.float64)

    def prepare(self, op, buffers):
        if op != "copy" or buffers.inplace:
            raise Unsupported("memcpy only copies one buffer into another")
        send, recv = buffers.send, buffers.recv

        def run():
            np.copyto(recv, send)
            return recv
        return run

    def close(self):
        pass


def _copy_times(nbytes, iters, start, results):
    """One copying process: `iters` timed copies, each begun together with the other copiers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)  # written once below, so page faults stay out of the timing
    np.copyto(dst, src)
    times = []
    for _ in range(iters):
        start.wait()
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    results.put(times)


def copy_bandwidth(nprocs, nbytes=REFERENCE_BYTES, iters=REFERENCE_ITERS, timeout_s=60):
    """Bytes copied per second by `nprocs` processes copying `nbytes` each at the same time, in total (median over
    iterations of nprocs * nbytes / the slowest copier's time)."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    start, results = ctx.Barrier(nprocs, timeout=timeout_s), ctx.Queue()
    procs = [ctx.Process(target=_copy_times, args=(nbytes, iters, start, results)) for _ in range(nprocs)]
    for proc in procs:
        proc.start()
    try:
        per_proc = [results.get(timeout=timeout_s) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
    slowest = np.max(np.array(per_proc), axis=0)
    return nprocs * nbytes / float(np.median(slowest))


def reference():
    """The machine line's two numbers."""
    return {"bytes": REFERENCE_BYTES, "one_process_Bps": copy_bandwidth(1), "two_processes_Bps": copy_bandwidth(2)}
