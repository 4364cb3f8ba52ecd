# SPDX-License-Identifier: Apache-2.0
"""Streamed against plain remote exchanges, in one job: the box exchange whose d comes back in parts while x still goes
(csrc/net/box_session.c, serve_streamed) against the one that sends all of x and then receives all of d.

    python -m benchmarks.simhosts_bench --hosts 2 --ranks-per-host 1 [--rate 1gbit] \\
        --script benchmarks/exchange_stream.py --bytes 4K,256K,1M,16M [--iters 30] [--script-args=--both]

Alone (the default): the last rank exchanges with a box homed on host 0 while the others wait, as an asynchronous
worker's exchange mostly finds the link to itself. --both: every rank exchanges at once with a box striped over the
hosts, as benchmarks.smb's exchange rows do. Both ways alternate inside each of --rounds rounds; each prints the
medians, ms per exchange (the slowest rank's), and plain over streamed (above 1: streaming is faster). Exchanges below
box_client.STREAM_BYTES are plain either way."""
import argparse
import time

import numpy as np

import shmcomm
from shmcomm.smb import client as box_client

STREAMED = box_client.STREAM_BYTES
NEVER = 1 << 62


def parse_sizes(text):
    from benchmarks.collectives import parse_size
    return [parse_size(item) for item in text.split(",") if item]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", default="4K,256K,1M,16M")
    parser.add_argument("--iters", type=int, default=30, help="exchanges per measurement (fewer from 4 MiB)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--both", action="store_true", help="every rank exchanges at once, box striped")
    args = parser.parse_args()
    shmcomm.init()
    rank, size = shmcomm.rank(), shmcomm.size()
    hosts = shmcomm.cross_size()
    active = True if args.both else rank == size - 1
    if rank == 0:
        print("# %s, %d hosts x %d ranks: ms per exchange, medians of %d rounds; plain/streamed above 1: streaming "
              "is faster" % ("every rank at once, box striped" if args.both else "the last rank alone, box on host 0",
                             hosts, shmcomm.local_size(), args.rounds), flush=True)
    for nbytes in parse_sizes(args.bytes):
        count = max(nbytes // 4, 1)
        box = shmcomm.SoftMemoryBox("exchange_stream.%d" % nbytes, shape=(count,), dtype=np.float32, home=0,
                                    stripes=hosts if args.both else 1)
        x = np.ones(count, np.float32)
        iters = args.iters if nbytes < (4 << 20) else max(args.iters // 5, 3)
        times = {"streamed": [], "plain": []}
        for _ in range(args.rounds):
            for way, threshold in (("streamed", STREAMED), ("plain", NEVER)):
                box_client.STREAM_BYTES = threshold
                for _ in range(args.warmup if active else 0):
                    box.exchange(x.copy(), 0.5)
                shmcomm.barrier()
                start = time.perf_counter()
                for _ in range(iters if active else 0):
                    box.exchange(x.copy(), 0.5)
                took = (time.perf_counter() - start) / iters
                times[way].append(shmcomm.allreduce(np.array([took]), op=shmcomm.Max)[0])
        box_client.STREAM_BYTES = STREAMED
        if rank == 0:
            streamed, plain = np.median(times["streamed"]) * 1e3, np.median(times["plain"]) * 1e3
            print("%10d bytes  streamed %9.3f ms  plain %9.3f ms  plain/streamed %5.2f" % (nbytes, streamed, plain,
                                                                                       plain / streamed), flush=True)
        box.close()
    shmcomm.shutdown()


if __name__ == "__main__":
    main()
