# SPDX-License-Identifier: Apache-2.0
"""python -m shmcomm.sim: predicted all-reduce times per algorithm for a machine described on the command line."""
import argparse
import json
import re
import sys

from shmcomm.sim.model import LinkModel, Machine, best_grid, default_grid, predict

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_SIZE = re.compile(r"^%s\s*([KMGT]?)(?:i?B)?$" % _NUMBER, re.IGNORECASE)
_BANDWIDTH = re.compile(r"^%s\s*(?:([kKMGT]?)(B|bit|b)(?:/s|ps))?$" % _NUMBER)
_TIME = re.compile(r"^%s\s*(s|ms|us|µs|ns)?$" % _NUMBER)
_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_DECIMAL_PREFIXES = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_TIME_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_size(text: str) -> int:
    """'100M' -> 104857600: K, M, G, T are powers of 1024, an optional B or iB after them."""
    match = _SIZE.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError("invalid size %r: use a positive number of bytes with an optional K, M, G "
                                         "or T (powers of 1024), e.g. 100M or 1.5GiB" % text)
    return int(round(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]))


def parse_bandwidth(text: str) -> float:
    """'12.5GB/s' -> 12.5e9 bytes/s; '100Gbit/s' (or Gb/s, Gbps) -> 12.5e9. Prefixes are powers of 1000."""
    match = _BANDWIDTH.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError("invalid bandwidth %r: use a positive number with B/s, KB/s, MB/s, GB/s, "
                                         "TB/s (bytes, powers of 1000) or Mbit/s, Gbit/s (bits), e.g. 12.5GB/s" % text)
    value = float(match.group(1)) * _DECIMAL_PREFIXES[match.group(2) or ""]
    return value / 8 if match.group(3) in ("bit", "b") else value


def parse_time(text: str) -> float:
    """'2us' -> 2e-6 seconds; s, ms, us (or µs) and ns; a bare number is seconds."""
    match = _TIME.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError("invalid time %r: use a number >= 0 with s, ms, us or ns, e.g. 2us" % text)
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def parse_time_per_byte(text: str) -> float:
    """'0.1ns/B' -> 1e-10 seconds per byte; a bare number is seconds per byte."""
    stripped = text.strip()
    try:
        return parse_time(stripped[:-2] if stripped.endswith("/B") else stripped)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError("invalid reduction cost %r: use a time per byte, e.g. 0.1ns/B" % text)


def parse_grid(text: str):
    match = re.match(r"^\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*$", text)
    if not match or min(int(match.group(1)), int(match.group(2))) < 1:
        raise argparse.ArgumentTypeError("invalid grid %r: use XxY with X ranks per row and Y rows, e.g. 32x34" % text)
    return int(match.group(1)), int(match.group(2))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shmcomm.sim", description="Predict all-reduce time with the alpha-beta-gamma model: flat "
        "ring, 2D torus, hierarchical and parameter-server star. Sizes take K/M/G (powers of 1024); bandwidths "
        "GB/s (1e9 bytes/s) or Gbit/s (1e9/8); times s, ms, us, ns.")
    parser.add_argument("--ranks", type=int, required=True, help="ranks in the job (N)")
    parser.add_argument("--local", type=int, required=True, help="ranks per host (rows of the default grid)")
    parser.add_argument("--bytes", type=parse_size, required=True, help="bytes each rank all-reduces (M)")
    parser.add_argument("--inter-bw", type=parse_bandwidth, required=True, help="one host's NIC, per direction")
    parser.add_argument("--inter-lat", type=parse_time, required=True, help="latency of a message between hosts")
    parser.add_argument("--intra-bw", type=parse_bandwidth, default=50e9, help="between two ranks of a host "
                        "(default 50GB/s)")
    parser.add_argument("--intra-lat", type=parse_time, default=0.5e-6, help="inside a host (default 0.5us)")
    parser.add_argument("--gamma", type=parse_time_per_byte, default=0.1e-9,
                        help="time to reduce one byte (default 0.1ns/B)")
    parser.add_argument("--grid", type=parse_grid, help="also predict the torus on this grid, XxY with X*Y = ranks")
    parser.add_argument("--servers", type=int, default=1, help="parameter servers the star stripes over (default 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return "%.4g %s" % (value / scale, unit)
    return "%.4g ns" % (value * 1e9)


def _bytes(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return "%.4g %s" % (value / scale, unit)
    return "%.4g B" % value


def _rate(bytes_per_s: float) -> str:
    return "%.4g GB/s" % (bytes_per_s / 1e9)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.local < 1 or args.ranks % args.local:
        parser.error("--ranks (%d) must be a positive multiple of --local (%d)" % (args.ranks, args.local))
    if args.grid and args.grid[0] * args.grid[1] != args.ranks:
        parser.error("--grid %dx%d covers %d ranks, not --ranks %d"
                     % (args.grid[0], args.grid[1], args.grid[0] * args.grid[1], args.ranks))
    if args.servers < 1:
        parser.error("--servers must be >= 1")
    machine = Machine(args.ranks, args.local, LinkModel.from_bandwidth(args.intra_lat, args.intra_bw),
                      LinkModel.from_bandwidth(args.inter_lat, args.inter_bw), args.gamma)
    predictions = predict(machine, args.bytes, grid=args.grid, servers=args.servers)
    ring_seconds = predictions[0].seconds
    home, best = default_grid(machine), best_grid(machine, args.bytes)
    notes = {}  # algorithm label -> remarks for the last column of the table
    for label, remark in (("torus %dx%d" % home, "rows inside hosts"), ("torus %dx%d" % best, "best grid"),
                          ("torus %dx%d" % args.grid if args.grid else None, "--grid"),
                          (predictions[-1].algorithm, "%d server%s" % (args.servers, "s"[:args.servers > 1]))):
        notes.setdefault(label, []).append(remark)

    if args.json:
        print(json.dumps({
            "machine": {"ranks": machine.ranks, "local": machine.local, "hosts": machine.hosts,
                        "intra": {"latency_s": args.intra_lat, "bandwidth_bytes_per_s": args.intra_bw},
                        "inter": {"latency_s": args.inter_lat, "bandwidth_bytes_per_s": args.inter_bw},
                        "gamma_s_per_byte": args.gamma},
            "bytes": args.bytes, "servers": args.servers, "default_grid": list(home), "best_grid": list(best),
            "predictions": [dict(p._asdict(), speedup_vs_ring=ring_seconds / p.seconds) for p in predictions],
        }, indent=2))
        return 0

    print("%d ranks, %d per host on %d host%s; all-reduce of %s per rank"
          % (machine.ranks, machine.local, machine.hosts, "s"[:machine.hosts > 1], _bytes(args.bytes)))
    print("intra %s + %s per rank pair; inter %s + %s per host NIC, shared by its ranks; gamma %s/B"
          % (_seconds(args.intra_lat), _rate(args.intra_bw), _seconds(args.inter_lat), _rate(args.inter_bw),
             _seconds(args.gamma)))
    print()
    row = "%-16s %12s %7s %22s %9s   %s"
    print((row % ("algorithm", "time", "steps", "inter-host bytes/rank", "vs ring", "")).rstrip())
    for p in predictions:
        speedup = ("%.2fx" if ring_seconds >= 0.1 * p.seconds else "%.2gx") % (ring_seconds / p.seconds)
        print((row % (p.algorithm, _seconds(p.seconds), p.steps, _bytes(p.inter_bytes_per_rank), speedup,
                      ", ".join(notes.get(p.algorithm, [])))).rstrip())
    spans = "rows inside hosts" if best[0] <= machine.local else "each row spans %.3g hosts" % (best[0] / machine.local)
    print("\nbest grid: %dx%d (%s)" % (best[0], best[1], spans))
    print("inter-host bytes/rank is the most one rank sends across hosts; a host's NIC carries its ranks' sum.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
