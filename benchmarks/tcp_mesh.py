# SPDX-License-Identifier: Apache-2.0
"""The elastic world's TCP mesh (shmcomm/transport/tcp.py) on this host: how long a world's mesh takes to form
(every connection's handshake included) and its allreduce's time per call, medians and p90 over the calls of a
round, then the median over rounds (each round a new world of new processes).

    python -m benchmarks.tcp_mesh [-np 2] [-b 4K -e 16M -f 4] [-n 30] [--rounds 3] [--cpu-load N]
"""
import argparse
import multiprocessing
import socket
import time

import numpy as np

from benchmarks.collectives import parse_size, sweep
from shmcomm.transport.tcp import Tcp
from shmcomm.transport.tcp_connect import connect_mesh
from shmcomm.transport import memory
from shmcomm.vocabulary import dtypes
from shmcomm._native import lib
from shmcomm.testing import cpu_load

_SECRET = bytes(range(32))


def _rank(rank, listeners, addresses, sizes, iterations, out):
    started = time.perf_counter()
    sockets = connect_mesh(listeners[rank], addresses, rank, "bench", _SECRET, 60)
    formed = time.perf_counter() - started
    mesh = Tcp(sockets, rank, range(len(addresses)), ["h%d" % r for r in range(len(addresses))], 60)
    times = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        address = memory.address(x)
        code = dtypes.numpy_code(x.dtype)
        spent = []
        for i in range(iterations + 3):  # 3 calls to warm up
            begin = time.perf_counter()
            mesh.allreduce(address, address, x.size, code, lib.SMC_SUM, 1.0, 1.0, 1, 0, "bench")
            spent.append(time.perf_counter() - begin)
        times[nbytes] = spent[3:]
    mesh.close()
    if rank == 0:
        out.put((formed, times))


def one_round(ranks, sizes, iterations):
    """(seconds rank 0 took to form the mesh, {bytes: [seconds per allreduce]})."""
    listeners = [socket.create_server(("127.0.0.1", 0), backlog=64) for _ in range(ranks)]
    addresses = ["127.0.0.1:%d" % s.getsockname()[1] for s in listeners]
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    processes = [context.Process(target=_rank, args=(r, listeners, addresses, sizes, iterations, out))
                 for r in range(ranks)]
    for p in processes:
        p.start()
    result = out.get(timeout=600)
    for p in processes:
        p.join(60)
    for s in listeners:
        s.close()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2)
    parser.add_argument("-b", default="4K")
    parser.add_argument("-e", default="16M")
    parser.add_argument("-f", type=int, default=4)
    parser.add_argument("-n", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-load", type=int, default=0)
    args = parser.parse_args()
    sizes = sweep(parse_size(args.b), parse_size(args.e), args.f)
    with cpu_load.spinning(args.cpu_load):
        rounds = [one_round(args.np, sizes, args.n) for _ in range(args.rounds)]
    print("| mesh set-up ms | %.2f |" % (1e3 * np.median([formed for formed, _ in rounds])))
    print("| bytes | allreduce median us | p90 us |\n|---|---|---|")
    for nbytes in sizes:
        medians = [np.median(times[nbytes]) for _, times in rounds]
        p90s = [np.percentile(times[nbytes], 90) for _, times in rounds]
        print("| %d | %.1f | %.1f |" % (nbytes, 1e6 * np.median(medians), 1e6 * np.median(p90s)))


if __name__ == "__main__":
    main()
