# SPDX-License-Identifier: Apache-2.0
"""The kernel's copy (process_vm_readv, what single copy runs on) against a memcpy, with the remote buffer on 4 KiB
pages and on transparent huge pages:

    python -m benchmarks.kernel_copy [--bytes 128K,1M,4M,16M,64M] [--tries 20]

One process reads its own memory, as the init probe does (csrc/coll/cma.c): the kernel pins and maps each remote page
as it does a peer's. The remote range is collapsed into huge pages with madvise(MADV_COLLAPSE) (Linux 6.1), which is
what SHMCOMM_HUGE_PAGES does to the buffers peers reach (csrc/coll/huge_pages.c). Best of --tries each."""
import argparse
import ctypes
import mmap
import os
import time

import numpy as np

MADV_COLLAPSE = 25
HUGE = 2 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.process_vm_readv.argtypes = (ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                                      ctypes.c_ulong, ctypes.c_ulong)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    return libc


def _buffer(nbytes):
    """A private anonymous mapping of its own, 64 bytes in (as malloc's arrays start), touched: on 4 KiB pages."""
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=np.uint8, count=nbytes, offset=64)
    array[:] = 1
    return array


def _collapse(libc, array):
    """Collapses the whole huge pages inside `array`; the fraction of it they cover, or None if the kernel refused."""
    start = (array.ctypes.data + HUGE - 1) & ~(HUGE - 1)
    end = (array.ctypes.data + array.nbytes) & ~(HUGE - 1)
    if end <= start:
        return 0.0
    return (end - start) / array.nbytes if libc.madvise(start, end - start, MADV_COLLAPSE) == 0 else None


def _best(fn, tries):
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _machine():
    """The processor's model name and the kernel's release, as the system reports them."""
    model = "unknown processor"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
        with open("/proc/sys/kernel/osrelease") as f:
            return "%s, Linux %s" % (model, f.read().strip())
    except OSError:
        return model


def main(argv=None):
    from benchmarks.collectives import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", default="128K,1M,4M,16M,64M")
    parser.add_argument("--tries", type=int, default=20)
    options = parser.parse_args(argv)
    libc, pid = _libc(), os.getpid()
    print("# python -m benchmarks.kernel_copy --bytes %s --tries %d | %s UTC | %s" % (
        options.bytes, options.tries, time.strftime("%Y-%m-%d %H:%M", time.gmtime()), _machine()))
    print("#   bytes  memcpy us  kernel us (4 KiB pages)  kernel us (huge pages, share of the buffer)")
    for nbytes in (parse_size(s) for s in options.bytes.split(",") if s.strip()):
        remote, local = _buffer(nbytes), _buffer(nbytes)
        local_iov, remote_iov = _Iovec(local.ctypes.data, nbytes), _Iovec(remote.ctypes.data, nbytes)

        def kernel():
            if libc.process_vm_readv(pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0) != nbytes:
                raise OSError(ctypes.get_errno(), "process_vm_readv: %s" % os.strerror(ctypes.get_errno()))

        memcpy = _best(lambda: np.copyto(local, remote), options.tries)
        small = _best(kernel, options.tries)
        share = _collapse(libc, remote)
        huge = _best(kernel, options.tries) if share else None
        print("%9d %10.1f %10.1f (%.2fx memcpy) %s" % (
            nbytes, memcpy * 1e6, small * 1e6, small / memcpy,
            "%10.1f (%.2fx memcpy, %.0f%%)" % (huge * 1e6, huge / memcpy, 100 * share) if huge else
            "     - (%s)" % ("no whole huge page inside" if share == 0 else "the kernel refused MADV_COLLAPSE")))


if __name__ == "__main__":
    main()
