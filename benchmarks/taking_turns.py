# SPDX-License-Identifier: Apache-2.0
"""Two or more libraries timed taking turns call by call in one job, each call after a barrier, as the benchmarks of
peers that run in shmcomm's own processes do (torch.distributed, DeepSpeed, oneCCL): their options, the turns, the
slowest rank's figures and the sizes as the tables print them."""
import argparse
import time

import numpy as np

import shmcomm
from benchmarks.collectives import parse_size


def alternating(calls, iters):
    """{library: seconds of each of `iters` calls}, the libraries' calls taking turns (each after a barrier, the order
    reversed every other turn), so that whatever the machine does meets them alike; two calls each first, untimed."""
    for call in calls.values():
        call()
        call()
    libraries = list(calls)
    times = {library: [] for library in libraries}
    for i in range(iters):
        for library in libraries if i % 2 == 0 else libraries[::-1]:
            shmcomm.barrier()
            start = time.perf_counter()
            calls[library]()
            times[library].append(time.perf_counter() - start)
    return times


def slowest_rank(times):
    """The slowest rank's median and 90th percentile of these times."""
    return shmcomm.allgather(np.array([[np.median(times), np.percentile(times, 90)]])).max(axis=0)


def parser_for(doc, sizes):
    """A parser of the options every such benchmark takes (--bytes, defaulting to `sizes`, --rounds, --iters,
    --cpu-load), described by the first line of `doc`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--bytes", default=sizes, help="comma-separated sizes, K/M/G suffixes allowed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per library, case and round")
    parser.add_argument("--cpu-load", type=int, default=0, help="CPU-bound processes beside the job")
    return parser


def chosen(parser, text, kinds, listed):
    """The comma-separated `text` of option --`listed` as a list, each one of `kinds` (else the parser's error)."""
    picked = text.split(",")
    unknown = sorted(set(picked) - set(kinds))
    if unknown:
        parser.error("unknown %s %s; choose from %s" % (listed, unknown, ",".join(kinds)))
    return picked


def sizes_of(options):
    """The sizes in bytes that --bytes names."""
    return [parse_size(s) for s in options.bytes.split(",")]


def parse_options(argv, doc, sizes, kinds, listed):
    """The options of a benchmark taking turns: (options, sizes in bytes, the kinds asked for), where `kinds` names
    what --`listed` chooses from (ops, dtypes)."""
    parser = parser_for(doc, sizes)
    parser.add_argument("--" + listed, default=",".join(kinds))
    options = parser.parse_args(argv)
    return options, sizes_of(options), chosen(parser, getattr(options, listed), kinds, listed)


def size_text(nbytes):
    """`nbytes` as the tables print it: 8 B, 64 KiB, 16 MiB."""
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return "%d %siB" % (nbytes >> shift, unit)
    return "%d B" % nbytes
