# SPDX-License-Identifier: Apache-2.0
"""Collectives on CUDA tensors (torch), run by the engine's thread in the agreed order on this rank's own stream after
an event recorded on the caller's: nothing synchronizes the device. Paths chosen once per job (startup/devices.py):
NCCL where every rank has a GPU of its own (one call, or the 2D torus: nccl_torus.py), else pinned host memory in
chunks the world communicator reduces as their copies finish. docs/architecture.md, "CUDA tensors", says more."""
import logging
import math
import pickle
import socket
import threading

from shmcomm.startup import devices
from shmcomm import env
from shmcomm.vocabulary import ops
from shmcomm.algorithms import nccl_torus
from shmcomm.algorithms.device_buffers import NCCL_OPS, aligned_offsets, nccl_dtype, widened
from shmcomm.vocabulary.description import shares
from shmcomm.vocabulary.exceptions import InvalidArgumentError, NotSupportedError, ShmCommError, TimeoutError
from shmcomm.transport import cuda_kernels
from shmcomm.transport.nccl import NcclComm, wait_for
from shmcomm.transport.nccl_library import load as load_nccl, load_problem

log = logging.getLogger("shmcomm.algorithms")

# The host path copies and reduces in chunks of this size, so that the copies of one chunk overlap the collective of
# another. Every rank chunks alike: the size is a constant and the counts are agreed.
STAGING_CHUNK_BYTES = 8 << 20
_created = threading.Lock()


def communicator(world):
    """The DeviceComm that serves CUDA tensors next to the world communicator `world` (made on first use, closed
    with it)."""
    with _created:
        comm = getattr(world, "device_comm", None)
        if comm is None:
            comm = world.device_comm = DeviceComm(world)
            world.closables.append(comm)
    return comm


def require_cuda(torch):
    """Raises InvalidArgumentError unless this process's torch can run CUDA work."""
    if not torch.cuda.is_available():
        raise InvalidArgumentError("CUDA tensors need a CUDA build of torch and a visible GPU; this process has torch "
                                   "%s, whose torch.cuda.is_available() is False" % torch.__version__)


class DeviceComm:
    """CUDA tensors' collectives next to the world communicator `world` (whose ranks, liveness and host collectives
    it uses)."""

    on_device = True

    def __init__(self, world):
        import torch

        require_cuda(torch)
        self.torch = torch
        self.world = world
        self.ranks, self.rank, self.size = world.ranks, world.rank, world.size
        self.topology, self.tuning = world.topology, world.tuning
        self.device = None   # this rank's CUDA device: every CUDA tensor of a rank must be on it
        self.stream = None   # this rank's stream for collectives
        self.path = None     # "nccl" or "host", agreed at the first collective
        self.nccl = self.row = self.column = self.kernels = None
        self.failed = None   # why the path could not be set up (every later CUDA collective raises it)
        self._keep = []      # host buffers the work in flight still copies from or to

    def refused(self, kind, error, what):
        return self.world.refused(kind, error, what)

    # ---- the caller's thread ----
    def prepare(self, req):
        """At submission: the checks, and the point on the caller's stream after which the tensor is ready."""
        torch, x = self.torch, req.tensor
        if self.device is None:
            self.device = x.device
            self.stream = torch.cuda.Stream(x.device)
        elif x.device != self.device:
            raise InvalidArgumentError("%s: tensor is on %s, but this rank's CUDA tensors are on %s (one device per "
                                       "rank)" % (req.what, x.device, self.device))
        if req.op == ops.Adasum:
            raise NotSupportedError("%s: Adasum is not supported for CUDA tensors" % req.what)
        out = req.output
        if out is not None and out is not x:
            if req.kind in ("allgather", "alltoall"):
                raise NotSupportedError("%s: output= is not supported for CUDA tensors; the result is a new tensor"
                                        % req.what)
            shape = tuple(x.shape)
            if req.kind == "reducescatter" and shape:
                shape = (shares(shape[0], self.size)[self.rank],) + shape[1:]
            if not (isinstance(out, torch.Tensor) and out.device == x.device and out.dtype == x.dtype and
                    out.is_contiguous() and tuple(out.shape) == shape):
                raise InvalidArgumentError("%s: output must be a contiguous %s tensor on %s of shape %s"
                                           % (req.what, x.dtype, x.device, list(shape)))
        caller = torch.cuda.current_stream(x.device)
        ready = torch.cuda.Event()
        ready.record(caller)
        req.ready = (ready, caller)

    # ---- the engine's thread ----
    def run(self, req):
        """Runs one request; its result as the host communicator's would be."""
        torch = self.torch
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._agree_on_path()
            self.stream.wait_event(req.ready[0])
            result = getattr(self, "_" + req.kind)(req)
            outputs = [result[0] if req.kind == "alltoall" else result]
            self._finish(req.what, [(out, req.ready[1]) for out in outputs])
        return result

    def run_fused(self, reqs):
        """Allreduces of one dtype, op and scale factors, packed on the device and reduced once; {name: output}."""
        torch = self.torch
        first = reqs[0]
        what = "fused allreduce of %s" % ", ".join(r.name for r in reqs[:3]) + (" ..." if len(reqs) > 3 else "")
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._agree_on_path()
            for r in reqs:
                self.stream.wait_event(r.ready[0])
            sizes = [r.tensor.numel() for r in reqs]
            offsets, length = aligned_offsets(sizes, first.tensor.element_size())
            flat = torch.empty(length, dtype=first.tensor.dtype, device=self.device)  # gaps: reduced, never read
            pieces = [flat[at:at + n] for at, n in zip(offsets, sizes)]
            self._copy_many([(r.tensor.view(-1), piece) for r, piece in zip(reqs, pieces)])
            self._allreduce_flat(flat, first.op, first.prescale, first.postscale, what)
            outputs = [r.tensor if r.output is r.tensor else r.output if r.output is not None else
                       torch.empty_like(r.tensor) for r in reqs]
            self._copy_many([(piece, out.view(-1)) for piece, out in zip(pieces, outputs)])
            self._finish(what, [(out, r.ready[1]) for out, r in zip(outputs, reqs)])
        return {r.name: out for r, out in zip(reqs, outputs)}

    def close(self):
        for comm in [c for c in (self.row, self.column, self.nccl) if c is not None]:
            comm.close()

    # ---- the collectives ----
    def _allreduce(self, req):
        x = req.tensor
        out = x if req.output is x else req.output if req.output is not None else self.torch.empty_like(x)
        if out is not x:
            out.copy_(x)
        self._allreduce_flat(out.view(-1), req.op, req.prescale, req.postscale, req.what)
        return out

    def _broadcast(self, req):
        x, root = req.tensor, req.root
        out = x if req.output is x else req.output if req.output is not None else self.torch.empty_like(x)
        if self.path == "nccl":
            if x.numel():
                self.nccl.broadcast(x.data_ptr(), out.data_ptr(), x.numel() * x.element_size(), "uint8", root,
                                    self.stream.cuda_stream)
            return out
        host = self._staged(x) if self.rank == root else self._pinned(x.shape, x.dtype)
        self._wait_local(self._event(), req.what)  # the copies to host memory enqueued so far
        self.world.broadcast(host, host, root, req.what)
        out.copy_(host, non_blocking=True)
        return out

    def _allgather(self, req):
        x, torch = req.tensor, self.torch
        shape = tuple(x.shape) or (1,)
        rows = self._every(shape[0])
        row_bytes = self._row_bytes(x, shape)
        out = torch.empty((sum(rows),) + shape[1:], dtype=x.dtype, device=self.device)
        if self.path == "nccl":
            stream = self.stream.cuda_stream
            if len(set(rows)) == 1:
                if rows[0]:
                    self.nccl.allgather(x.data_ptr(), out.data_ptr(), rows[0] * row_bytes, "uint8", stream)
                return out
            with self.nccl.group():  # unequal rows: each rank broadcasts its own into place
                at = 0
                for r, n in enumerate(rows):
                    if n:
                        source = x.data_ptr() if r == self.rank else out.data_ptr() + at
                        self.nccl.broadcast(source, out.data_ptr() + at, n * row_bytes, "uint8", r, stream)
                    at += n * row_bytes
            return out
        host_out = self._pinned(out.shape, x.dtype)
        host = self._staged(x.reshape(shape))
        self._wait_local(self._event(), req.what)  # the copies to host memory enqueued so far
        self.world.allgather(host, req.what, host_out)
        out.copy_(host_out, non_blocking=True)
        return out

    def _reducescatter(self, req):
        x, torch = req.tensor, self.torch
        rows = shares(x.shape[0], self.size)
        mine, start = rows[self.rank], sum(rows[:self.rank])
        out = req.output if req.output is not None else torch.empty((mine,) + tuple(x.shape[1:]), dtype=x.dtype,
                                                                     device=self.device)  # prepare checked it
        if self.path == "nccl":
            work = x.clone()
            if len(set(rows)) == 1 and self.row is None:
                self._scale(work, req.prescale)
                work = widened(torch, work)
                got = out if work.dtype == out.dtype else torch.empty(out.shape, dtype=work.dtype, device=self.device)
                self.nccl.reducescatter(work.data_ptr(), got.data_ptr(), got.numel(), nccl_dtype(work, req.what),
                                        NCCL_OPS[req.op], self.stream.cuda_stream)
                if got is not out:
                    out.copy_(got)
                self._post(out, req.op, req.postscale)
            else:  # unequal shares (or the torus): reduce everything, keep this rank's rows
                self._allreduce_flat(work.view(-1), req.op, req.prescale, req.postscale, req.what)
                out.copy_(work[start:start + mine])
            return out
        host = self._staged(x)
        host_out = self._pinned(out.shape, x.dtype)
        self._wait_local(self._event(), req.what)  # the copies to host memory enqueued so far
        self.world.reducescatter(host, req.op, req.prescale, req.postscale, req.what, host_out)
        out.copy_(host_out, non_blocking=True)
        return out

    def _alltoall(self, req):
        x, torch, splits = req.tensor, self.torch, req.splits
        shape = tuple(x.shape) or (1,)
        every = self._every(list(splits))
        got = [every[j][self.rank] for j in range(self.size)]
        out = torch.empty((sum(got),) + shape[1:], dtype=x.dtype, device=self.device)
        if self.path == "nccl":
            row_bytes = self._row_bytes(x, shape)
            stream, sent, received = self.stream.cuda_stream, 0, 0
            with self.nccl.group():
                for j in range(self.size):
                    if splits[j]:
                        self.nccl.send(x.data_ptr() + sent, splits[j] * row_bytes, "uint8", j, stream)
                    if got[j]:
                        self.nccl.recv(out.data_ptr() + received, got[j] * row_bytes, "uint8", j, stream)
                    sent += splits[j] * row_bytes
                    received += got[j] * row_bytes
            return out, got
        host_out = self._pinned(out.shape, x.dtype)
        host = self._staged(x.reshape(shape))
        self._wait_local(self._event(), req.what)  # the copies to host memory enqueued so far
        _, got = self.world.alltoall(host, splits, req.what, host_out)
        out.copy_(host_out, non_blocking=True)
        return out, [int(g) for g in got]

    # ---- allreduce of one flat buffer, in place ----
    def _allreduce_flat(self, flat, op, prescale, postscale, what):
        if self.path == "host":
            self._staged_allreduce(flat, op, prescale, postscale, what)
            return
        self._scale(flat, prescale)
        wide = widened(self.torch, flat)
        dtype, n, stream = nccl_dtype(wide, what), flat.numel(), self.stream.cuda_stream
        if n and self.row is None:
            self.nccl.allreduce(wide.data_ptr(), wide.data_ptr(), n, dtype, NCCL_OPS[op], stream)
        elif n:
            padded = nccl_torus.padded_count(n, self.row.size)
            work = wide if padded == n else self.torch.zeros(padded, dtype=wide.dtype, device=self.device)
            if work is not wide:
                work[:n].copy_(wide)
            piece = self.torch.empty(padded // self.row.size, dtype=wide.dtype, device=self.device)
            nccl_torus.torus_allreduce(self.row, self.column, work.data_ptr(), piece.data_ptr(), padded, dtype,
                                       NCCL_OPS[op], stream)
            if work is not wide:
                wide.copy_(work[:n])
        if wide is not flat:
            flat.copy_(wide)
        self._post(flat, op, postscale)

    def _staged_allreduce(self, flat, op, prescale, postscale, what):
        """Chunk by chunk: each chunk's copy to host memory was enqueued before, so it overlaps the collectives of
        the chunks before it, and its copy back overlaps the collectives of the chunks after it."""
        host = self._pinned(flat.shape, flat.dtype)
        step = max(1, STAGING_CHUNK_BYTES // flat.element_size())
        chunks = [(a, min(a + step, flat.numel())) for a in range(0, flat.numel(), step)]
        copied = []
        for a, b in chunks:
            host[a:b].copy_(flat[a:b], non_blocking=True)
            copied.append(self._event())
        for (a, b), event in zip(chunks, copied):
            self._wait_local(event, what)
            piece = host[a:b]
            self.world.allreduce(piece, piece, op, prescale, postscale, what)
            flat[a:b].copy_(piece, non_blocking=True)

    # ---- helpers ----
    def _agree_on_path(self):
        """Once, at the first CUDA collective, on every rank at once: the job's path, and its NCCL communicators."""
        if self.path is not None:
            return
        if self.failed is not None:  # the ranks cannot agree again: they may have failed differently
            raise self.failed
        try:
            self._choose_path()
        except ShmCommError as error:
            self.failed = error
            raise

    def _choose_path(self):
        torch = self.torch
        # A rank that cannot load NCCL says why, and every rank then stages through host memory.
        mine = devices.describe_torch_device(torch, self.device, socket.gethostname(), load_problem())
        mine["requested"] = env.gpu_path()
        everyone = self._every(mine)
        if len({d["requested"] for d in everyone}) != 1:
            raise InvalidArgumentError("SHMCOMM_GPU_PATH must be the same on every rank, got %s"
                                       % [d["requested"] for d in everyone])
        path, why = devices.choose_path(everyone, mine["requested"])
        if path == "nccl":
            self._open_nccl()
        self.kernels = cuda_kernels.load(torch.cuda.get_device_capability(self.device))
        self.path = path
        log.info("CUDA tensors take the %s path (%s)%s; CUDA kernels: %s", path, why,
                 ", 2D torus %dx%d" % (self.row.size, self.column.size) if self.row is not None else "",
                 self.kernels.path if self.kernels else "none (%s)" % cuda_kernels.unavailable(
                     torch.cuda.get_device_capability(self.device)))

    def _open_nccl(self):
        library = load_nccl()
        unique_id = self.world.allgather_bytes(library.unique_id() if self.rank == 0 else b"")[0]
        self.nccl = NcclComm.create(unique_id, self.rank, self.ranks, self.tuning.timeout_s, self.world.failed_ranks,
                                    library, on_thread=lambda: self.torch.cuda.set_device(self.device))
        paths = env.paths(self.size)
        grid = nccl_torus.layout(self.size, self.world.host_groups, paths.algorithm, paths.grid)
        if grid is not None:
            (row_color, row_key, row_ranks), (column_color, column_key, column_ranks) = \
                nccl_torus.row_and_column(self.rank, *grid)
            self.row = self.nccl.split(row_color, row_key, row_ranks)
            self.column = self.nccl.split(column_color, column_key, column_ranks)

    def _every(self, value):
        """Every rank's `value`, through the host memory's world communicator (bounded by its deadline)."""
        return [pickle.loads(blob) for blob in self.world.allgather_bytes(pickle.dumps(value))]

    def _finish(self, what, outputs):
        """Waits, bounded, until this stream's work is done; then the outputs belong to their callers' streams."""
        done = self._event()
        if self.path == "nccl":
            self.nccl.wait(done.query, what, also=[c for c in (self.row, self.column) if c is not None])
        else:
            self._wait_local(done, what)
        self._keep.clear()
        for out, caller in outputs:
            if out.numel():
                out.record_stream(caller)

    def _wait_local(self, event, what):
        if wait_for(event.query, lambda: 0, self.tuning.timeout_s) is not None:
            raise TimeoutError("%s: copies between the GPU and host memory did not finish within %.0f s "
                               "(SHMCOMM_TIMEOUT)" % (what, self.tuning.timeout_s))

    def _event(self):
        event = self.torch.cuda.Event()
        event.record(self.stream)
        return event

    def _pinned(self, shape, dtype):
        buffer = self.torch.empty(shape, dtype=dtype, pin_memory=True)
        self._keep.append(buffer)
        return buffer

    def _staged(self, x):
        host = self._pinned(x.shape, x.dtype)
        host.copy_(x, non_blocking=True)
        return host

    @staticmethod
    def _row_bytes(x, shape):
        return math.prod(shape[1:]) * x.element_size()

    def _scale(self, t, factor):
        """t *= factor in place on this stream (integers truncate, as in host memory)."""
        if factor == 1.0 or not t.numel():
            return
        name = str(t.dtype).replace("torch.", "")
        if self.kernels is not None and name in cuda_kernels.DTYPES:
            self.kernels.scale(t.data_ptr(), t.numel(), name, factor, self.stream.cuda_stream)
        elif t.is_floating_point():
            t.mul_(factor)
        else:
            t.copy_(self.torch.trunc(t.double() * factor))

    def _post(self, t, op, postscale):
        """The postscale, and the average's division by the world size (NCCL summed)."""
        if op != ops.Average:
            self._scale(t, postscale)
        elif t.is_floating_point():
            self._scale(t, postscale / self.size)
        else:
            self._scale(t, postscale)
            t.div_(self.size, rounding_mode="trunc")

    def _copy_many(self, pairs):
        """[(src, dst)] device tensors of equal sizes: one batched kernel where it was built, torch's copies
        otherwise."""
        if self.kernels is not None:
            self.kernels.copy_batch([(s.data_ptr(), d.data_ptr(), s.numel() * s.element_size()) for s, d in pairs
                                     if s.numel()], self.stream.cuda_stream)
            return
        for src, dst in pairs:
            dst.copy_(src)
