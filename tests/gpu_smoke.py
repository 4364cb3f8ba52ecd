# SPDX-License-Identifier: Apache-2.0
"""One process on one GPU, no launcher: what a single GPU can show of shmcomm's NCCL transport and CUDA kernels
(benchmarks/gpu_check.sh runs it first). A one-rank non-blocking NCCL communicator and two splits of it; every NCCL
dtype and op through allreduce, and broadcast, allgather, reducescatter and send/recv to itself; the 2D torus's three
steps on the split communicators; a failed call inside a group; the CUDA kernels against torch on odd sizes and
alignments. Prints "ok <check>" for each and exits non-zero at the first failure; without a GPU it says so and exits
0 after what needs none (loading NCCL, a unique id)."""
import sys
import time

import torch

from shmcomm.algorithms import nccl_torus
from shmcomm.transport import cuda_kernels, nccl, nccl_library

# NCCL's dtypes as torch makes them; the unsigned 32- and 64-bit ones as the signed ones' bits (torch's own
# operations on those dtypes are few), which NCCL then reads as unsigned.
TORCH_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "uint32": torch.int32,
                "int64": torch.int64, "uint64": torch.int64, "float16": torch.float16, "float32": torch.float32,
                "float64": torch.float64, "bfloat16": torch.bfloat16}


def ok(check, started):
    print("ok %s (%.2f s)" % (check, time.monotonic() - started), flush=True)


def one_rank(library, dev):
    uid = library.unique_id()
    return nccl.NcclComm.create(uid, 0, [0], 60.0, library=library, on_thread=lambda: torch.cuda.set_device(dev))


def ready(stream):
    """NCCL's stream waits for the buffers made on the current one (torch's streams do not wait for each other)."""
    stream.wait_stream(torch.cuda.current_stream())


def wait(comm, stream, what, also=()):
    done = torch.cuda.Event()
    done.record(stream)
    comm.wait(done.query, what, also)


def values(name, n, dev):
    # Small non-negative values: exact in every dtype, unsigned ones included.
    return (torch.arange(n, dtype=torch.int64) % 7 + 1).to(TORCH_DTYPES[name]).to(dev)


def check_every_dtype_and_op(comm, stream, dev):
    for name in nccl_library.DTYPES:
        floating = name.startswith(("float", "bfloat"))
        for op in [op for op in nccl_library.OPS if op != "average" or floating]:  # averages are of floats
            x = values(name, 1001, dev)
            out = torch.empty_like(x)
            ready(stream)
            comm.allreduce(x.data_ptr(), out.data_ptr(), x.numel(), name, op, stream.cuda_stream)
            wait(comm, stream, "allreduce %s %s" % (name, op))
            assert torch.equal(out.cpu(), x.cpu()), (name, op)  # one rank: every reduction is the input


def check_data_movement(comm, stream, dev):
    x = values("float32", 4099, dev)
    out = torch.zeros_like(x)
    s = stream.cuda_stream
    ready(stream)
    comm.broadcast(x.data_ptr(), out.data_ptr(), x.numel(), "float32", 0, s)
    wait(comm, stream, "broadcast")
    assert torch.equal(out, x)
    out.zero_()
    ready(stream)
    comm.allgather(x.data_ptr(), out.data_ptr(), x.numel(), "float32", s)
    wait(comm, stream, "allgather")
    assert torch.equal(out, x)
    out.zero_()
    ready(stream)
    comm.reducescatter(x.data_ptr(), out.data_ptr(), x.numel(), "float32", "sum", s)
    wait(comm, stream, "reducescatter")
    assert torch.equal(out, x)
    out.zero_()
    ready(stream)
    with comm.group():  # a send to itself and its receive must be launched together
        comm.send(x.data_ptr(), x.numel(), "float32", 0, s)
        comm.recv(out.data_ptr(), x.numel(), "float32", 0, s)
    wait(comm, stream, "send/recv")
    assert torch.equal(out, x)


def check_torus_on_splits(comm, stream, dev):
    (row_color, row_key, row_ranks), (column_color, column_key, column_ranks) = nccl_torus.row_and_column(0, 1, 1)
    row = comm.split(row_color, row_key, row_ranks)
    column = comm.split(column_color, column_key, column_ranks)
    assert (row.size, row.rank, column.size, column.rank) == (1, 0, 1, 0)
    x = values("bfloat16", 999, dev)
    padded = nccl_torus.padded_count(x.numel(), row.size)
    work = torch.zeros(padded, dtype=x.dtype, device=dev)
    work[:x.numel()].copy_(x)
    piece = torch.empty(padded // row.size, dtype=x.dtype, device=dev)
    ready(stream)
    nccl_torus.torus_allreduce(row, column, work.data_ptr(), piece.data_ptr(), padded, "bfloat16", "max",
                               stream.cuda_stream)
    wait(row, stream, "torus", also=[column])
    assert torch.equal(work[:x.numel()], x)
    row.close()
    column.close()


def check_a_failure_inside_a_group(library, dev):
    comm = one_rank(library, dev)
    x = torch.zeros(4, device=dev)
    try:
        with comm.group():  # a dtype NCCL does not have: refused when the call is made
            comm._call("ncclAllReduce", comm._ptr(x.data_ptr()), comm._ptr(x.data_ptr()), 4, 99, 0, comm.handle,
                       comm._stream(0))
    except nccl_library.NcclError as error:
        assert comm.broken is error and comm.handle is None, (comm.broken, comm.handle)
    else:
        raise AssertionError("NCCL took an allreduce of dtype 99")


def check_kernels(dev):
    kernels = cuda_kernels.load(torch.cuda.get_device_capability(dev))
    assert kernels is not None, cuda_kernels.unavailable(torch.cuda.get_device_capability(dev))
    stream = torch.cuda.current_stream(dev)
    for name in cuda_kernels.DTYPES:
        for n in (1, 7, 4097, 1000003):
            x = torch.randn(n, dtype=torch.float64, device=dev).to(getattr(torch, name))
            want = (x.float() * 0.37).to(x.dtype) if x.element_size() == 2 else x * 0.37
            kernels.scale(x.data_ptr(), n, name, 0.37, stream.cuda_stream)
            torch.cuda.synchronize(dev)
            rtol = {2: 1e-2, 4: 1e-6, 8: 1e-12}[x.element_size()]
            assert torch.allclose(x.double(), want.double(), rtol=rtol), name
    source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=dev)
    target = torch.zeros_like(source)
    copies, want = [], torch.zeros_like(source)
    at = 0
    for src_offset, nbytes, gap in ((0, 16, 0), (1, 15, 3), (16, 4096, 13), (3, 1, 0), (32, 65537, 16), (5, 0, 1)):
        copies.append((source.data_ptr() + src_offset, target.data_ptr() + at, nbytes))
        want[at:at + nbytes] = source[src_offset:src_offset + nbytes]
        at += nbytes + gap
    copies *= 40  # more than one launch's batch
    kernels.copy_batch(copies, stream.cuda_stream)
    torch.cuda.synchronize(dev)
    assert torch.equal(target, want)


def main():
    started = time.monotonic()
    library = nccl_library.load()
    library.unique_id()
    print("NCCL %s from %s (%s)" % (library.version_text, library.path, library.found_by), flush=True)
    if not torch.cuda.is_available():
        print("no GPU: torch %s sees none; the checks that need one did not run" % torch.__version__)
        return 0
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    print("GPU:", torch.cuda.get_device_name(dev), "capability", torch.cuda.get_device_capability(dev), flush=True)
    comm = one_rank(library, dev)
    ok("a non-blocking communicator of one rank", started)
    stream = torch.cuda.Stream(dev)
    for check in (check_every_dtype_and_op, check_data_movement, check_torus_on_splits):
        began = time.monotonic()
        check(comm, stream, dev)
        ok(check.__name__[len("check_"):], began)
    comm.close()
    began = time.monotonic()
    check_a_failure_inside_a_group(library, dev)
    ok("a_failure_inside_a_group", began)
    began = time.monotonic()
    check_kernels(dev)
    ok("kernels", began)
    print("smoke: every check passed in %.1f s" % (time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
