# SPDX-License-Identifier: Apache-2.0
"""The collectives under test: how big each buffer is for a message size, what fills them, what the result must be,
and the bus-bandwidth factor, one class per collective (the nccl-tests convention)."""
from dataclasses import dataclass

import numpy as np


@dataclass
class Layout:
    count: int  # the `count` column, in elements
    send: int  # elements of this rank's input
    recv: int  # elements of this rank's output
    block: int  # elements per rank block

    def bytes(self, itemsize):  # the `size` column
        return self.count * itemsize


def ramp(length, dtype, start=0):
    """(start + i) % 7 for i < length: small integers, so sums over ranks are exact in every dtype."""
    return np.resize(np.roll(np.arange(7, dtype=dtype), -(start % 7)), length)


class AllReduce:
    name, redop, root = "allreduce", "sum", -1
    gathers = False  # whether the in-place input is this rank's block of the output

    @staticmethod
    def busbw_factor(n):
        return 2.0 * (n - 1) / n

    @staticmethod
    def layout(elems, n):
        c = max(1, elems)
        return Layout(count=c, send=c, recv=c, block=c)

    @staticmethod
    def data(rank, n, lay, dtype):
        return ramp(lay.send, dtype) + (rank + 1)

    @staticmethod
    def expected(rank, n, lay, dtype):
        return ramp(lay.recv, dtype) * n + n * (n + 1) // 2


class Broadcast(AllReduce):
    name, redop, root = "broadcast", "none", 0

    @staticmethod
    def busbw_factor(n):
        return 1.0

    @staticmethod
    def data(rank, n, lay, dtype):  # only the root's input may reach the output
        return ramp(lay.send, dtype) + 1 if rank == 0 else np.zeros(lay.send, dtype)

    @staticmethod
    def expected(rank, n, lay, dtype):
        return ramp(lay.recv, dtype) + 1


class AllGather:
    name, redop, root = "allgather", "none", -1
    gathers = True

    @staticmethod
    def busbw_factor(n):
        return (n - 1.0) / n

    @staticmethod
    def layout(elems, n):  # nccl-tests: size and count are of the whole output
        total = max(n, elems // n * n)
        return Layout(count=total, send=total // n, recv=total, block=total // n)

    @staticmethod
    def data(rank, n, lay, dtype):
        return ramp(lay.send, dtype) + (rank + 1)

    @staticmethod
    def expected(rank, n, lay, dtype):
        return np.concatenate([ramp(lay.block, dtype) + (q + 1) for q in range(n)])


class ReduceScatter:
    name, redop, root = "reducescatter", "sum", -1
    gathers = False

    @staticmethod
    def busbw_factor(n):
        return (n - 1.0) / n

    @staticmethod
    def layout(elems, n):  # nccl-tests: size and count are of the whole input
        total = max(n, elems // n * n)
        return Layout(count=total, send=total, recv=total // n, block=total // n)

    @staticmethod
    def data(rank, n, lay, dtype):
        return ramp(lay.send, dtype) + (rank + 1)

    @staticmethod
    def expected(rank, n, lay, dtype):
        return ramp(lay.block, dtype, start=rank * lay.block) * n + n * (n + 1) // 2


class AllToAll:
    name, redop, root = "alltoall", "none", -1
    gathers = False

    @staticmethod
    def busbw_factor(n):
        return (n - 1.0) / n

    @staticmethod
    def layout(elems, n):
        c = max(n, elems // n * n)
        return Layout(count=c, send=c, recv=c, block=c // n)

    @staticmethod
    def _block(sender, receiver, n, lay, dtype):  # tells every (sender, receiver) pair apart, in int8 too
        return ramp(lay.block, dtype) + ((sender * n + receiver) % 64 + 1)

    @classmethod
    def data(cls, rank, n, lay, dtype):
        return np.concatenate([cls._block(rank, j, n, lay, dtype) for j in range(n)])

    @classmethod
    def expected(cls, rank, n, lay, dtype):
        return np.concatenate([cls._block(q, rank, n, lay, dtype) for q in range(n)])


class Copy(AllReduce):
    """memcpy's only operation: bytes copied per second, so its busbw is its algbw."""
    name, redop, root = "copy", "none", -1

    @staticmethod
    def busbw_factor(n):
        return 1.0

    @staticmethod
    def data(rank, n, lay, dtype):
        return ramp(lay.send, dtype) + 1

    @staticmethod
    def expected(rank, n, lay, dtype):
        return ramp(lay.recv, dtype) + 1


COLLECTIVES = {c.name: c for c in (AllReduce, Broadcast, AllGather, ReduceScatter, AllToAll, Copy)}
