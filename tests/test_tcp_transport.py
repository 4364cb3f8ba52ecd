# SPDX-License-Identifier: Apache-2.0
"""The TCP transport of elastic worlds across hosts (shmcomm/transport/tcp.py), on this host's loopback: a mesh of
ranks in threads, every collective against numpy with the same bits on every rank, a closed peer named at once, a
late one after the deadline, and a straggler of an older world turned away."""
import socket
import threading

import numpy as np
import pytest

from shmcomm.vocabulary import dtypes
from shmcomm._native import ffi, lib
from shmcomm.vocabulary.exceptions import BrokenCommunicatorError, RankFailure, TimeoutError
from shmcomm.transport import handshake
from shmcomm.transport.tcp import Tcp, connect_mesh

SECRET = bytes(range(32))  # the job's secret, as shmcommrun would hand it to the ranks


def _listeners(n):
    out = []
    for _ in range(n):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        out.append(sock)
    return out, ["127.0.0.1:%d" % s.getsockname()[1] for s in out]


def _on_every_rank(n, job, timeout_s=20.0, token="t1"):
    """job(transport) in a thread per rank; returns their results in rank order (raises the first error)."""
    listeners, addresses = _listeners(n)
    results, errors = [None] * n, []

    def rank_main(r):
        try:
            transport = Tcp(connect_mesh(listeners[r], addresses, r, token, SECRET, timeout_s), r, range(n),
                            ["host%d" % i for i in range(n)], timeout_s)
            try:
                results[r] = job(transport)
            finally:
                transport.close()
        except BaseException as error:  # noqa: B902 (reported below)
            errors.append(error)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for sock in listeners:
        sock.close()
    if errors:
        raise errors[0]
    return results


def _ptr(a):
    return ffi.from_buffer(a)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16])
def test_allreduce_and_reducescatter_match_numpy_with_the_same_bits_everywhere(n, dtype):
    count = 1001
    inputs = [(np.random.default_rng(r).standard_normal(count) * 10).astype(dtype) for r in range(n)]
    code = dtypes.numpy_code(np.dtype(dtype))
    half = 1.0 if dtype == np.int32 else 0.5

    def job(t):
        out = inputs[t.rank].copy()
        t.allreduce(_ptr(out), _ptr(out), count, code, lib.SMC_SUM, 1.0, half, 1, 0, "allreduce")
        biggest = np.empty_like(out)
        t.allreduce(_ptr(inputs[t.rank]), _ptr(biggest), count, code, lib.SMC_MAX, 1.0, 1.0, 1, 0, "max")
        counts = [count // n + (r < count % n) for r in range(n)]
        mine = np.empty(counts[t.rank], dtype)
        t.reducescatter(_ptr(inputs[t.rank]), _ptr(mine), counts, code, lib.SMC_SUM, 1.0, 1.0, 1, 0, "rs")
        return out, biggest, mine, counts
    results = _on_every_rank(n, job)
    wide = np.float64 if dtype != np.int32 else np.int64
    expected = sum(i.astype(wide) for i in inputs) * (0.5 if dtype != np.int32 else 1)
    tolerance = 2e-2 if dtype == np.float16 else 1e-5
    for out, biggest, mine, counts in results:
        assert out.tobytes() == results[0][0].tobytes()  # the same bits on every rank
        if dtype == np.int32:
            assert np.array_equal(out, expected.astype(np.int32))
        else:
            np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tolerance, atol=tolerance)
        assert np.array_equal(biggest, np.max(inputs, axis=0))
    whole = np.concatenate([r[2] for r in results])
    np.testing.assert_allclose(whole.astype(np.float64), sum(i.astype(wide) for i in inputs), rtol=tolerance,
                               atol=tolerance * 10)


def test_broadcast_allgather_alltoall_barrier_and_bytes():
    n = 3

    def job(t):
        r = t.rank
        data = np.full(8, r + 1, np.uint8)
        t.broadcast(_ptr(data), _ptr(data), 8, 1, 0, "broadcast")
        sizes = [2, 0, 5]
        every = np.empty(sum(sizes), np.uint8)
        t.allgatherv(_ptr(np.full(sizes[r], r, np.uint8)), sizes[r], _ptr(every), sizes, 0, "allgather")
        send = np.array([10 * r + j for j in range(n) for _ in range(j + 1)], np.uint8)
        got = np.empty((r + 1) * n, np.uint8)
        t.alltoallv(_ptr(send), [1, 2, 3], _ptr(got), [r + 1] * n, 0, "alltoall")
        t.barrier()
        return data, every, got, t.allgather_bytes(b"x" * (r * 3000))
    for r, (data, every, got, payloads) in enumerate(_on_every_rank(n, job)):
        assert list(data) == [2] * 8
        assert list(every) == [0, 0, 2, 2, 2, 2, 2]
        assert list(got) == [10 * s + r for s in range(n) for _ in range(r + 1)]
        assert payloads == [b"x" * (s * 3000) for s in range(n)]


def test_a_closed_peer_is_named_at_once_and_the_transport_refuses_afterwards():
    def job(t):
        if t.rank == 1:
            return None
        buf = np.zeros(4, np.uint8)
        with pytest.raises(RankFailure, match="rank 1 on host1 closed its connection") as failure:
            t.broadcast(_ptr(buf), _ptr(buf), 4, 1, 0, "broadcast")
        assert failure.value.rank == 1
        with pytest.raises(BrokenCommunicatorError):
            t.barrier()
        return True
    assert _on_every_rank(2, job)[0] is True


def test_a_late_peer_times_out_and_the_transport_refuses_afterwards():
    release = threading.Event()

    def job(t):
        if t.rank == 1:
            release.wait(10)
            return None
        t.timeout_s = 0.5
        with pytest.raises(TimeoutError, match="rank 1 on host1"):
            t.barrier()
        release.set()
        with pytest.raises(BrokenCommunicatorError):
            t.barrier()
        return True
    assert _on_every_rank(2, job)[0] is True


def test_a_connection_of_an_older_world_is_turned_away():
    listeners, addresses = _listeners(2)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r0=connect_mesh(listeners[0], addresses, 0, "new", SECRET,
                                                                           10)))
    thread.start()
    stale = socket.create_connection(("127.0.0.1", listeners[0].getsockname()[1]))
    handshake.prove(stale, SECRET, "rank 0")  # a rank of this job, still in its older world
    stale.sendall(b"old-token".ljust(64, b"\0") + (1).to_bytes(8, "little"))
    fresh = connect_mesh(listeners[1], addresses, 1, "new", SECRET, 10)
    thread.join(20)
    mine, theirs = fresh[0], result["r0"][1]
    mine.setblocking(True)
    mine.sendall(b"hi")
    theirs.setblocking(True)
    assert theirs.recv(2) == b"hi"  # the world's own connection, not the straggler's
    for sock in [stale, mine, theirs] + listeners:
        sock.close()
