# SPDX-License-Identifier: Apache-2.0
"""The communicator of a job that spans hosts, or of a logical grid on one host (SHMCOMM_TORUS_GRID).

It offers what host.HostComm offers, so the API and the engine use either unchanged. Allreduce goes through the
algorithm choice.py picks (torus, ring or MPI's own); the other collectives go through the MPI transport across
hosts, or through the host's shared memory when the whole grid is on one host. Every collective starts with the
agreement (through the torus's route when there is a torus), so that ranks that disagree, or call different
collectives, all raise instead of corrupting data or waiting in MPI."""
import functools

import numpy as np

from shmcomm.vocabulary import description, ops
from shmcomm._native import lib
from shmcomm.transport import memory
from shmcomm.algorithms import adasum, choice
from shmcomm.algorithms.agreement import MISMATCH, OK, REFUSED, Agreement, Refused, failure_text, refusal_error
from shmcomm.algorithms.communicator import Communicator
from shmcomm.algorithms.disagreement import disagreement_error
from shmcomm.algorithms.ring import ring_allreduce
from shmcomm.algorithms.torus2d import verdict_error
from shmcomm.vocabulary.buffers import output_for, output_or_scratch, require_reducible, row_bytes, wrap
from shmcomm.vocabulary.exceptions import (BrokenCommunicatorError, InvalidArgumentError, MismatchError, RankFailure,
                                           ShmCommError, TimeoutError)
from shmcomm.transport import kernels
from shmcomm.smb.rollcall import name_silent_ranks


def _naming_holdups(method):
    """A collective that timed out or failed (not for a bad argument or a mismatch) names the ranks that do not
    answer a roll call (stopped, hung or gone): the rank it waited for, or whose step failed, may itself have been
    waiting for them."""
    @functools.wraps(method)
    def named(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (TimeoutError, RankFailure, BrokenCommunicatorError) as error:
            name_silent_ranks(error, self.roll_call)
            raise
        except ShmCommError as error:
            if type(error) is ShmCommError:  # a step that failed elsewhere ("its own error says why")
                name_silent_ranks(error, self.roll_call)
            raise
    return named


class WorldComm(Communicator):
    """`host`: this host's algorithms.host.HostComm; `torus`: a torus2d.Torus, or None (hosts of unequal sizes);
    `across`: the transport over the whole job across hosts (MPI; the TCP mesh in an elastic world), None for a grid
    on one host; `paths`: env.PathSettings;
    `host_groups`: the job ranks of each host; `ranks`: the job ranks it holds (a process set's), every rank by
    default."""

    def __init__(self, topology, tuning, host, torus, paths, across=None, host_groups=None, ranks=None):
        super().__init__(host.shm, topology, tuning, range(topology.size) if ranks is None else ranks)
        self.host_groups = [list(g) for g in host_groups] if host_groups is not None else [self.ranks]
        self.host = host
        self.torus = torus
        self.across = across
        self.torus_min_bytes = paths.torus_min_bytes
        # A small allreduce of a numpy array may take the torus's small path in one C call
        # (csrc/py/quick_crossing.c, through quick_path.py): its smc_crossing_call_t, where the rounds are compiled.
        self.quick_call = self.quick_crossing = None
        if torus is not None and across is not None:
            quick = torus.column.quick_call(self.size, (across.usable_flag, torus.column.transport.usable_flag),
                                            torus.row, topology.rank)
            if quick is not None:
                self.quick_call, self.quick_crossing = quick
        self.algorithm = choice.validate(paths.algorithm, torus is not None, across is not None)
        # Without a torus, every cross-host collective starts with this.
        self.agreement = Agreement(across) if across is not None and torus is None else None
        self.roll_call = None  # transport.rollcall.RollCall across hosts: a timeout names the ranks holding it up

    @property
    def algorithm(self):
        return self._algorithm

    @algorithm.setter
    def algorithm(self, name):
        """Also the sizes the quick allreduce takes: those that choice.allreduce gives the torus's small path."""
        self._algorithm = name
        if self.quick_call is not None:
            torus = name in ("auto", "torus")
            self.quick_call.min_bytes = self.torus_min_bytes if name == "auto" else 0
            self.quick_call.max_bytes = self.torus.small_bytes if torus else 0

    @_naming_holdups
    def quick_allreduce_failed(self, got, x, op, prescale, postscale, what):
        """Raises what the full path raises where the quick allreduce returned `got` (csrc/py/quick_crossing.c): the
        stage that failed and its code, or the verdict that was not OK; the torus's small path goes on from there."""
        stage, torus = got[0], self.torus
        if stage == "rounds":
            raise torus.column.quick_failed(got[1], self.quick_call)
        if stage == "broadcast":
            raise torus.row.failure(got[1], what)
        op, buf = ops.resolve(op), wrap(x, what)
        collective = description.describe("allreduce", buf.code, x.shape, op, float(prescale), float(postscale))
        divisor = self.size if op == ops.Average else 1
        sig = collective.signature(buf.count, divisor, True)
        try:
            if stage == "row":
                verdict = torus.after_quick_row(torus.row.failure(got[1], what), buf.count * buf.itemsize, buf.code,
                                                ops.C_OP[op], float(postscale), divisor, sig, what)
            else:
                verdict = torus.after_quick_verdict(got[1:], sig)
            raise verdict_error(what, verdict)
        except MismatchError:
            raise self._disagreement(what, collective) from None
        except Refused:
            raise refusal_error(what, None, self.across, self.host.shm) from None

    # ---- allreduce ----
    @_naming_holdups
    def allreduce(self, x, output, op, prescale, postscale, what):
        inplace = output is x
        src = wrap(x, what, inplace)
        require_reducible(src, what)
        out, dst = (x, src) if inplace else output_for(src, output, src.shape, what)
        if op == ops.Adasum:
            self.adasum(src.ptr, dst.ptr, src.count, src.code, [src.count], prescale, postscale, what, src.shape)
            return out
        self._allreduce(src.ptr, dst.ptr, src.count, src.code, src.itemsize, op, prescale, postscale, what, None,
                        description.describe("allreduce", src.code, src.shape, op, float(prescale), float(postscale)))
        return out

    @_naming_holdups
    def allreduce_raw(self, ptr, count, code, op, prescale, postscale, what, divisor=None):
        self._allreduce(ptr, ptr, count, code, kernels.itemsize(code), op, prescale, postscale, what, divisor,
                        description.describe("allreduce", code, (count,), op, float(prescale), float(postscale)))

    def _allreduce(self, ptr, dst_ptr, count, code, esize, op, prescale, postscale, what, divisor, collective):
        if self.across is not None and self.across.broken:
            self.across.usable(what)  # raises
        divisor = (self.size if op == ops.Average else 1) if divisor is None else divisor
        c_op = ops.C_OP[op]
        algorithm = choice.allreduce(self.algorithm, count * esize, self.torus is not None, self.across is not None,
                                     self.torus_min_bytes)
        narrow = None
        if code in kernels.HALF and algorithm != "mpi":
            # The torus and the ring reduce in steps, each of which would round to 16 bits: they carry float32, and
            # the result is rounded once, as on one host (the MPI transport widens, scales and rounds by itself).
            narrow = (memory.view(dst_ptr, count * esize), code)
            wide = kernels.widened(memory.view(ptr, count * esize), code)
            ptr = dst_ptr = memory.address(wide)
            code, esize = lib.SMC_FLOAT32, 4
        try:
            if algorithm == "torus":
                self.torus.allreduce(ptr, dst_ptr, count, code, esize, c_op, prescale, postscale, divisor, what,
                                     collective)
            else:
                self._agree(collective.signature(count, divisor), what)
        except MismatchError:
            raise self._disagreement(what, collective) from None
        except Refused:  # a rank's own checks failed: every rank now hears why
            raise refusal_error(what, None, self.across, self.host.shm) from None
        if algorithm != "torus":
            if dst_ptr != ptr:
                memory.copy(dst_ptr, ptr, count * esize)
            if algorithm == "ring":
                raw = memory.view(dst_ptr, count * esize)
                ring_allreduce(self.across, raw, code, c_op, prescale, postscale, divisor)
            else:
                self.across.allreduce(dst_ptr, dst_ptr, count, code, c_op, prescale, postscale, divisor, 0, what)
        if narrow is not None:
            kernels.narrow_into(narrow[0], wide, narrow[1])

    @_naming_holdups
    def adasum(self, ptr, dst_ptr, count, code, sizes, prescale, postscale, what, shape=None):
        """Adasum (algorithms/adasum.py), hierarchical where there is a torus: the levels inside a host over its
        shared memory, then the levels between hosts over the column; over the world's MPI otherwise (hosts of
        unequal sizes). The agreement comes first, so that ranks that disagree all raise."""
        collective = description.describe("allreduce", code, tuple(sizes) if shape is None else tuple(shape),
                                          ops.Adasum, float(prescale), float(postscale))
        self._checked(what, collective, None, tuple(sizes))
        tag = collective.signature(*sizes)
        if self.torus is not None:
            stages = [adasum.stage_for(self.torus.row, tag, what), adasum.stage_for(self.torus.column.transport, tag,
                                                                                      what)]
        else:
            stages = [adasum.stage_for(self.across, tag, what)]
        adasum.run(stages, ptr, dst_ptr, count, code, sizes, prescale, postscale, what)

    def _agree(self, sig, what):
        """Across hosts, before MPI carries a collective: raises MismatchError on every rank if they disagree, and
        TimeoutError if one does not come (MPI itself would check neither)."""
        if self.across is not None:
            self.across.usable(what)
        status, culprit = self.torus.agree(sig, what) if self.torus is not None else self.agreement.agree(sig)
        if status != OK:
            if status == REFUSED:
                raise Refused(culprit)
            raise MismatchError(what) if status == MISMATCH else ShmCommError(failure_text(what, culprit))

    def refuse(self, kind, reason, what):
        """This rank's call failed its own checks: the agreement every collective starts with carries REFUSED
        instead of a signature, then the ranks swap reasons (Communicator.refused)."""
        if self.across is not None:
            self.across.usable(what)
        if self.torus is not None:
            status, _ = self.torus.agree(0, what, refusal=reason)
        else:
            status, _ = self.agreement.agree(0, REFUSED, self.ranks[self.rank] + 1)  # the culprit's job rank + 1
        if status == REFUSED:
            refusal_error(what, reason, self.across, self.host.shm)

    def _disagreement(self, what, collective, buf=None):
        """The error every rank raises after a mismatch, naming what each rank passed."""
        names = {buf.dtype_key(): buf.type_name()} if buf is not None else None
        return disagreement_error(what, collective, self.across, self.host.shm, names, self.ranks)

    def _checked(self, what, collective, buf=None, extra=()):
        """The agreement on `collective` (and `extra` numbers that must agree too)."""
        try:
            self._agree(collective.signature(*extra), what)
        except MismatchError:
            raise self._disagreement(what, collective, buf) from None
        except Refused:
            raise refusal_error(what, None, self.across, self.host.shm) from None

    # ---- the rest: MPI across hosts, shared memory on one host. Each starts with the agreement, so that ranks
    # calling different collectives find out as surely as ranks passing different tensors. ----
    @_naming_holdups
    def broadcast(self, x, output, root, what):
        src = wrap(x, what, writable=output is x)
        out, dst = (x, src) if output is x else output_for(src, output, src.shape, what)  # before the agreement:
        self._checked(what, description.describe("broadcast", src.dtype_key(), src.shape, root=root), src)  # one
        if self.across is None:  # rank's error after it would leave the others waiting in MPI
            return self.host.broadcast(x, out, root, what)
        self.across.broadcast(src.ptr, dst.ptr, src.nbytes, root, 0, what)
        return out

    @_naming_holdups
    def allgather(self, x, what, output=None):
        src = self._check_rows(x, "allgather", what)
        if self.across is None:
            return self.host.allgather(x, what, output)
        shape = tuple(src.shape) or (1,)
        rows = self._first_dims(shape[0], what)
        size = row_bytes(src, shape)
        return self._into(src, output, (sum(rows),) + shape[1:], what, lambda dst: self.across.allgatherv(
            src.ptr, src.nbytes, dst.ptr, [r * size for r in rows], 0, what))

    @_naming_holdups
    def alltoall(self, x, splits, what, output=None):
        src = self._check_rows(x, "alltoall", what)
        if self.across is None:
            return self.host.alltoall(x, splits, what, output)
        shape = tuple(src.shape) or (1,)
        got = np.empty(self.size, dtype=np.int64)
        self.across.alltoallv(memory.address(np.array(splits, dtype=np.int64)), [8] * self.size, memory.address(got),
                           [8] * self.size, 0, what)
        size = row_bytes(src, shape)
        return self._into(src, output, (int(got.sum()),) + shape[1:], what, lambda dst: self.across.alltoallv(
            src.ptr, [s * size for s in splits], dst.ptr, [int(g) * size for g in got], 0, what)), got

    @staticmethod
    def _into(src, output, shape, what, move):
        """Runs move(dst) into the caller's output, checked now that the shape is known, or into a new array; a
        rank whose output does not fit still takes part (output_or_scratch), then raises."""
        out, dst, error = output_or_scratch(src, output, shape, what)
        move(dst)
        if error is not None:
            raise error
        return out

    def _check_rows(self, x, kind, what):
        """allgather and alltoall: the ranks' first dimensions may differ, the rest and the dtype may not."""
        src = wrap(x, what)
        self._checked(what, description.describe(kind, src.dtype_key(), tuple(src.shape) or (1,)), src)
        return src

    def _first_dims(self, first, what):
        mine = np.array([first], dtype=np.int64)
        every = np.empty(self.size, dtype=np.int64)
        self.across.allgatherv(memory.address(mine), 8, memory.address(every), [8] * self.size, 0, what)
        return [int(d) for d in every]

    @_naming_holdups
    def reducescatter(self, x, op, prescale, postscale, what, output=None):
        """This rank's rows of the reduction. MPI's own reduce-scatter where MPI's allreduce would be chosen; else
        the allreduce, then this rank's rows: twice the traffic of a true reduce-scatter, but the torus's."""
        src = wrap(x, what)
        require_reducible(src, what)
        if len(src.shape) == 0:
            raise InvalidArgumentError("%s: a tensor with at least one dimension is required" % what)
        collective = description.describe("reducescatter", src.code, src.shape, op, float(prescale), float(postscale))
        share = description.shares(src.shape[0], self.size)
        divisor = self.size if op == ops.Average else 1
        out, dst, error = output_or_scratch(src, output, (share[self.rank],) + tuple(src.shape[1:]), what)
        if choice.allreduce(self.algorithm, src.nbytes, self.torus is not None, self.across is not None,
                            self.torus_min_bytes) == "mpi":
            self._checked(what, collective, src, (src.count, divisor))
            per_row = src.count // src.shape[0] if src.shape[0] else 0
            self.across.reducescatter(src.ptr, dst.ptr, [s * per_row for s in share], src.code, ops.C_OP[op], prescale,
                                   postscale, divisor, 0, what)
        else:
            total, whole = output_for(src, None, src.shape, what)
            self._allreduce(src.ptr, whole.ptr, src.count, src.code, src.itemsize, op, prescale, postscale, what,
                            None, collective)
            start = sum(share[:self.rank])
            out[...] = total[start:start + share[self.rank]]
        if error is not None:
            raise error
        return out

    @_naming_holdups
    def barrier(self, what="barrier"):
        self._checked(what, description.describe("barrier"))
        if self.across is None:
            self.host.barrier(what)

    @_naming_holdups
    def shared_buffer(self, nbytes, what, tag=0):
        """`nbytes` (a uint8 array) that every rank of this host maps (host.HostComm.shared_buffer): the torus's row
        steps then read and write it directly, as a host's collectives do (the row's reduce-scatter reads each rank's
        share out of the peers' inputs, its allgather writes into the peers' outputs). Collective over the world:
        each host's ranks make theirs together, and that step compares only them, so every rank first hears every
        rank's size and tag, and a difference raises MismatchError on every rank."""
        mine = b"%d %d" % (nbytes, tag & description.MASK)
        everyone = self.allgather_bytes(mine)
        differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        if differ:
            size0, size = int(everyone[0].split()[0]), int(everyone[differ[0]].split()[0])
            raise MismatchError("%s: ranks disagree: rank %d asks for a shared buffer of %d bytes, rank %d for %d%s" % (
                what, self.ranks[0], size0, self.ranks[differ[0]], size, " of another shape or dtype" if size == size0
                else ""),
                field="shape" if size == size0 else "count")
        return self.host.shared_buffer(nbytes, what, tag)

    @_naming_holdups
    def allgather_bytes(self, payload):
        if self.across is None:
            return self.host.allgather_bytes(payload)
        return self.across.allgather_bytes(payload)
