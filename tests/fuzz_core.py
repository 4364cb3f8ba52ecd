# SPDX-License-Identifier: Apache-2.0
"""Drives every entry point of the C core (csrc/include/shmcomm.h, through cffi) with random and boundary arguments:
NULL pointers and handles, counts beyond the address space (negative numbers cast to unsigned among them), unknown
dtype, op and collective codes, NaN, negative and endless timeouts, names too long or empty, offsets past a box,
unlock without lock, a box used after it was destroyed. Every call must return a result code (never crash); calls
whose arguments are certainly wrong must return an error code.

    python tests/fuzz_core.py LOG [SEED] [ROUNDS]

Each call is written to LOG before it is made, so that whoever runs this in a subprocess can name the call that
crashed it (tests/test_fuzz.py). Buffers handed to the core are always as large as the sizes that come with them
say, or the sizes are ones the core must refuse: a pointer with a size larger than its memory (but a possible one)
is outside any C API's contract, as with memcpy. Exits 0 after printing "fuzz ok <calls>"."""
import math
import os
import random
import secrets
import socket
import struct
import sys

from shmcomm._native import ffi, lib

U64 = (1 << 64) - 1
MAX_BYTES = 1 << 57  # SMC_MAX_BYTES
CODES = set(range(0, 11))
HUGE = [1 << 57 | 1, 1 << 62, 1 << 63, U64, U64 - 7, (-1) & U64, (-8) & U64]  # beyond any buffer
BUFFER_BYTES = 4096
# Enum arguments (dtype, op, collective kind) are unsigned to cffi: -1 and INT_MIN arrive as these.
ENUM_NEGATIVE = [0xFFFFFFFF, 1 << 31]


class Fuzz:
    def __init__(self, log_path, seed):
        self.rng = random.Random(seed)
        self.log = open(log_path, "w", buffering=1)
        self.calls = 0
        self.buffers = [ffi.new("char[]", BUFFER_BYTES) for _ in range(4)]

    def call(self, name, args, must_fail=False, returns_code=True):
        """Calls lib.<name>(*args) after logging it; checks the result."""
        self.log.write("%s%r\n" % (name, tuple(_shown(a) for a in args)))
        self.calls += 1
        rc = getattr(lib, name)(*args)
        if returns_code:
            assert rc in CODES, "%s returned %r, not a result code" % (name, rc)
            assert not (must_fail and rc == 0), "%s%r succeeded" % (name, tuple(_shown(a) for a in args))
        return rc

    def pick(self, *pools):
        return self.rng.choice([v for pool in pools for v in pool])

    def pointer(self, nbytes):
        """NULL, or a buffer that holds nbytes (if nbytes can be held at all)."""
        if self.rng.random() < 0.2 or nbytes > BUFFER_BYTES:
            return ffi.NULL
        return self.rng.choice(self.buffers)


def _shown(a):
    if isinstance(a, ffi.CData):
        return "NULL" if a == ffi.NULL else ffi.typeof(a).cname
    return a


def config(fuzz, job_token, **bad):
    cfg = ffi.new("smc_config_t *")
    keep = ffi.new("char[]", job_token.encode())
    cfg.token, cfg.generation, cfg.rank, cfg.size = keep, 0, 0, 1
    cfg.start_timeout_s, cfg.timeout_s, cfg.liveness_s = 5.0, 5.0, 0.1
    cfg.slot_bytes, cfg.small_bytes, cfg.arena_bytes, cfg.spin_us = 1 << 16, 1 << 12, 1 << 16, 10
    cfg.job_ranks = ffi.NULL
    kept = [keep]
    for field, value in bad.items():
        if isinstance(value, (bytes, type(None))):
            value = ffi.NULL if value is None else ffi.new("char[]", value)
            kept.append(value)
        elif isinstance(value, list):
            value = ffi.new("int[]", value)
            kept.append(value)
        setattr(cfg, field, value)
    return cfg, kept


def fuzz_create(fuzz):
    out = ffi.new("smc_comm_t **")
    fuzz.call("smc_comm_create", (ffi.NULL, out), must_fail=True)
    cfg, _ = config(fuzz, secrets.token_hex(8))
    fuzz.call("smc_comm_create", (cfg, ffi.NULL), must_fail=True)
    bad_values = [
        ("token", None), ("token", b"short"), ("token", b"a" * 65), ("token", b"bad-char!x"), ("size", 0),
        ("size", -1), ("size", 1025), ("rank", -1), ("rank", 1), ("slot_bytes", 0), ("slot_bytes", 100),
        ("slot_bytes", U64), ("slot_bytes", 1 << 60), ("arena_bytes", U64), ("small_bytes", U64),
        ("timeout_s", 0.0), ("timeout_s", -1.0), ("timeout_s", math.nan), ("timeout_s", math.inf),
        ("start_timeout_s", math.nan), ("liveness_s", -math.inf), ("liveness_s", 0.0), ("job_ranks", [-1]),
        ("job_ranks", [-(1 << 31)]),
    ]
    for field, value in bad_values:
        cfg, _ = config(fuzz, secrets.token_hex(8), **{field: value})
        fuzz.call("smc_comm_create", (cfg, out), must_fail=True)
    cfg, keep = config(fuzz, secrets.token_hex(8), job_ranks=[7])
    assert fuzz.call("smc_comm_create", (cfg, out)) == 0, ffi.string(lib.smc_last_error())
    return out[0]


def fuzz_plain_calls(fuzz, comm):
    lib.smc_last_failure(ffi.NULL)
    ffi.string(lib.smc_last_error())
    for handle in (ffi.NULL, comm):
        for _ in range(30):
            rank = fuzz.pick([-(1 << 31), -5, -1, 0, 1, 1023, 1024, (1 << 31) - 1])
            fuzz.call("smc_comm_doorbell_ring", (handle, rank), returns_code=False)
            seen = fuzz.call("smc_comm_doorbell_value", (handle,), returns_code=False)
            timeout = fuzz.pick([0.0, -1.0, math.nan, -math.inf, 1e-4])
            fuzz.call("smc_comm_doorbell_wait", (handle, seen + fuzz.pick([0, 1]), timeout), returns_code=False)
            fuzz.call("smc_comm_set_spin", (handle, fuzz.pick([-(1 << 31), -1, 0, 5, (1 << 31) - 1]),
                                            fuzz.pick([-(1 << 31), -1, 0, 1000, (1 << 31) - 1])), returns_code=False)
            fuzz.call("smc_comm_failed_ranks", (handle,), returns_code=False)
            counts = ffi.new("uint64_t[3]")
            fuzz.call("smc_comm_waits", (handle, fuzz.pick([ffi.NULL, counts]), fuzz.pick([ffi.NULL, counts + 1]),
                                         fuzz.pick([ffi.NULL, counts + 2])), returns_code=False)
    fuzz.call("smc_comm_set_spin", (comm, 10, 10), returns_code=False)
    fuzz.call("smc_comm_destroy", (ffi.NULL,), returns_code=False)
    for dtype in ENUM_NEGATIVE + [0, 8, 9, 100, (1 << 31) - 1]:
        fuzz.call("smc_dtype_size", (dtype,), returns_code=False)


def _bad_dtype(d):
    return not 0 <= d < 9


def fuzz_collectives(fuzz, comm, rounds):
    dtypes = ENUM_NEGATIVE + [9, 77, (1 << 31) - 1]
    ops = ENUM_NEGATIVE + [4, 99]
    counts = [0, 1, 3, 64, 512]
    for _ in range(rounds):
        handle = comm if fuzz.rng.random() < 0.8 else ffi.NULL
        null_comm = handle == ffi.NULL
        dtype = fuzz.pick(range(9), dtypes)
        op = fuzz.pick(range(4), ops)
        count = fuzz.pick(counts, HUGE)
        esize = lib.smc_dtype_size(dtype) or 1
        nbytes = min(count * esize, U64)  # a size in bytes that large stays huge
        src, dst = fuzz.pointer(nbytes), fuzz.pointer(nbytes)
        divisor = fuzz.pick([1, 2, 0, -1, -(1 << 63)])
        scale = fuzz.pick([1.0, 0.5, math.nan, math.inf, -0.0])
        wrong = (null_comm or _bad_dtype(dtype) or not 0 <= op < 4 or divisor < 1 or nbytes > MAX_BYTES or
                 (count and (src == ffi.NULL or dst == ffi.NULL)))
        tag = fuzz.rng.getrandbits(64)
        fuzz.call("smc_allreduce", (handle, src, dst, count, dtype, op, scale, scale, divisor, tag), must_fail=wrong)
        counts_arg = fuzz.pick([[count], [fuzz.pick(HUGE)], None])
        counts_c = ffi.new("uint64_t[]", counts_arg) if counts_arg is not None else ffi.NULL
        fuzz.call("smc_reducescatter", (handle, src, dst, counts_c, dtype, op, scale, scale, divisor, 0),
                  must_fail=wrong or counts_arg is None or counts_arg[0] * esize > MAX_BYTES)
        root = fuzz.pick([0, -1, 1, 1 << 30])
        fuzz.call("smc_broadcast", (handle, src, dst, nbytes, root, 0),
                  must_fail=null_comm or root != 0 or nbytes > MAX_BYTES or (nbytes and dst == ffi.NULL))
        send = fuzz.pick([nbytes, 0, 8, fuzz.pick(HUGE)])
        recv = fuzz.pick([[send], [nbytes], [fuzz.pick(HUGE)], None])
        sizes = ffi.new("uint64_t[]", recv) if recv is not None else ffi.NULL
        src = fuzz.pointer(send)
        dst = fuzz.pointer(recv[0] if recv else 0)
        fuzz.call("smc_allgatherv", (handle, src, send, dst, sizes, 0),
                  must_fail=null_comm or recv is None or recv[0] != send or send > MAX_BYTES)
        send_sizes = fuzz.pick([[send], None])
        send_c = ffi.new("uint64_t[]", send_sizes) if send_sizes else ffi.NULL
        fuzz.call("smc_alltoallv", (handle, fuzz.pointer(send), send_c, dst, sizes, 0),
                  must_fail=null_comm or recv is None or send_sizes is None or send > MAX_BYTES or recv[0] != send)
        fuzz.call("smc_barrier", (handle,), must_fail=null_comm)
        reason = fuzz.pick([ffi.NULL, ffi.new("char[]", b"bad argument"), ffi.new("char[]", b"x" * 5000)])
        fuzz.call("smc_coll_refuse", (handle, fuzz.pick([0, 1, 2, 6, 7, 1 << 30], ENUM_NEGATIVE), reason),
                  must_fail=null_comm)


def fuzz_kernels(fuzz, rounds):
    for _ in range(rounds):
        dtype = fuzz.pick(range(9), ENUM_NEGATIVE, [9, 1 << 20])
        op = fuzz.pick(range(4), ENUM_NEGATIVE, [4])
        count = fuzz.pick([0, 1, 7, 100], HUGE)
        nbytes = min(count * (lib.smc_dtype_size(dtype) or 1), U64)
        nsrcs = fuzz.pick([-(1 << 31), -1, 0, 1, 3])
        dst = fuzz.pointer(nbytes)
        srcs_list = [fuzz.pointer(nbytes) for _ in range(max(nsrcs, 0))]
        srcs = ffi.new("void *[]", srcs_list) if nsrcs > 0 and fuzz.rng.random() < 0.9 else ffi.NULL
        divisor = fuzz.pick([1, 3, 0, -5])
        wrong = _bad_dtype(dtype) or not 0 <= op < 4 or nsrcs < 1 or divisor < 1 or nbytes > MAX_BYTES
        fuzz.call("smc_reduce", (dst, srcs, nsrcs, count, dtype, op, 1.0, 0.5, divisor), must_fail=wrong)
        src = fuzz.pointer(nbytes)
        fuzz.call("smc_axpby", (dst, src, count, dtype, fuzz.pick([1.0, -2.0, math.nan]), 1.0),
                  must_fail=_bad_dtype(dtype) or (count > 0 and nbytes > MAX_BYTES))


def fuzz_boxes(fuzz, comm, rounds):
    out = ffi.new("smc_box_t **")
    boxes = []
    names = [b"", b"n" * 64, b"n" * 63, b"box", b"box2", None]
    for _ in range(rounds):
        name_bytes = fuzz.pick(names)
        name = ffi.NULL if name_bytes is None else ffi.new("char[]", name_bytes)
        bad_name = name_bytes is None or not 0 < len(name_bytes) < 64
        handle = comm if fuzz.rng.random() < 0.9 else ffi.NULL
        action = fuzz.rng.randrange(3)
        if action == 0:
            count = fuzz.pick([0, 1, 16, 64], HUGE, [1 << 40])
            dtype = fuzz.pick(range(9), ENUM_NEGATIVE, [9])
            rc = fuzz.call("smc_box_create", (handle, name, count, dtype, fuzz.pick([0, 1]),
                                              out if fuzz.rng.random() < 0.95 else ffi.NULL),
                           must_fail=bad_name or handle == ffi.NULL or _bad_dtype(dtype) or count in HUGE)
            if rc == 0:
                boxes.append(out[0])
        elif action == 1:
            rc = fuzz.call("smc_box_attach", (handle, name, fuzz.pick([0.0, -1.0, math.nan, math.inf, 1e-3]), out),
                           must_fail=bad_name or handle == ffi.NULL)
            if rc == 0:
                boxes.append(out[0])
        else:
            fuzz.call("smc_box_destroy", (handle, name), must_fail=bad_name or handle == ffi.NULL)
        for box in [ffi.NULL] + boxes[-3:]:
            fuzz_box_ops(fuzz, box)
    for box in boxes:
        fuzz.call("smc_box_close", (box,), returns_code=False)
    fuzz.call("smc_box_close", (ffi.NULL,), returns_code=False)


def fuzz_box_ops(fuzz, box):
    null = box == ffi.NULL
    elements = lib.smc_box_count(box)
    esize = lib.smc_dtype_size(lib.smc_box_dtype(box)) or 1
    for name in ("smc_box_data", "smc_box_count", "smc_box_dtype", "smc_box_version"):
        fuzz.call(name, (box,), returns_code=False)
    version = ffi.new("uint64_t *")
    for op in ("smc_box_read", "smc_box_write", "smc_box_accumulate"):
        offset = fuzz.pick([0, 1, elements, elements + 1], HUGE)
        count = fuzz.pick([0, 1, max(elements - offset, 0) if offset <= elements else 0], HUGE)
        outside = offset > elements or count > elements - offset
        buf = fuzz.pointer(count * esize) if not outside else fuzz.pick([ffi.NULL, fuzz.buffers[0]])
        args = (box, offset, count, buf) + ((1.0, 1.0) if op == "smc_box_accumulate" else ()) + \
            (fuzz.pick([version, ffi.NULL]),)
        fuzz.call(op, args, must_fail=null or outside or (count > 0 and buf == ffi.NULL))
    offset = fuzz.pick([0, 1, elements, elements + 1], HUGE)
    count = fuzz.pick([0, 1, max(elements - offset, 0) if offset <= elements else 0], HUGE)
    outside = offset > elements or count > elements - offset
    buf = fuzz.pointer(count * esize) if not outside else fuzz.pick([ffi.NULL, fuzz.buffers[0]])
    bad = null or outside or (count > 0 and buf == ffi.NULL)
    fuzz.call("smc_box_exchange", (box, offset, count, buf, 0.5, fuzz.pick([version, ffi.NULL])), must_fail=bad)
    fuzz.call("smc_box_exchange_held", (box, offset, count, buf, 0.5), must_fail=True)  # the lock is not held
    timeout = fuzz.pick([0.0, 1e-3, -1.0, math.nan, math.inf])
    rc = fuzz.call("smc_box_lock", (box, timeout), must_fail=null or not (0 <= timeout < 1e9))
    fuzz.call("smc_box_unlock", (box,), must_fail=null or rc != 0)
    fuzz.call("smc_box_unlock", (box,), must_fail=True)  # not held (the lock is recursive: once more than locked)
    target = fuzz.pick([0, 1, 1 << 40], HUGE)
    fuzz.call("smc_box_wait_version", (box, target, fuzz.pick([0.0, 1e-3, -1.0, math.nan]), version),
              must_fail=null)


def fuzz_box_client(fuzz, rounds):
    """The box client's calls (net/box_request.c) on descriptors that are no connection (none, closed, never
    opened) and on one whose peer sends a reply no server sends: a receive returns SMC_WIRE_CLOSED or
    SMC_WIRE_TIMEOUT, at once or by its (tiny) deadline; a send may also have nothing to send, or send."""
    ends = []
    for _ in range(rounds):
        a, b = socket.socketpair()
        b.sendall(struct.pack("<iIQQII", 1, 1 << 20, 0, 0, 0, 0))  # an error text longer than any server's
        ends.append((a, b))
    closed = socket.socket()
    closed_fd = closed.detach()
    os.close(closed_fd)
    gone = (lib.SMC_WIRE_CLOSED, lib.SMC_WIRE_TIMEOUT)
    for i in range(rounds):
        fd = fuzz.pick([-1, closed_fd, 1 << 20, ends[i][0].fileno()])
        timeout = fuzz.pick([0.0, 1e-3, -1.0, math.nan])
        cap = fuzz.pick([0, 16, lib.SMC_WIRE_TEXT_BYTES])
        nbytes = fuzz.pick([0, 16])
        buf = fuzz.pointer(nbytes) if nbytes else ffi.NULL
        if buf == ffi.NULL:
            nbytes = 0
        reply, text = fuzz.buffers[1], fuzz.buffers[2]
        for name, args in (("smc_box_send", (fd, buf, nbytes, ffi.NULL, 0, timeout)),
                           ("smc_box_receive", (fd, buf, nbytes, timeout, reply, text, cap)),
                           ("smc_box_exchange_streamed", (fd, buf, nbytes, buf, nbytes, timeout, reply, text, cap))):
            rc = fuzz.call(name, args, returns_code=False)
            ok = rc in gone or (name == "smc_box_send" and rc == 0)  # sent, or nothing to send
            assert ok, "%s%r returned %r" % (name, tuple(_shown(a) for a in args), rc)
    for a, b in ends:
        a.close()
        b.close()


def main():
    log_path = sys.argv[1]
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    fuzz = Fuzz(log_path, seed)
    comm = fuzz_create(fuzz)
    try:
        fuzz_plain_calls(fuzz, comm)
        fuzz_collectives(fuzz, comm, rounds)
        fuzz_kernels(fuzz, rounds)
        fuzz_boxes(fuzz, comm, rounds)
        fuzz_box_client(fuzz, min(rounds, 50))
    finally:
        lib.smc_comm_destroy(comm)
    print("fuzz ok %d calls" % fuzz.calls, flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
