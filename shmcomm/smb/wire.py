# SPDX-License-Identifier: Apache-2.0
"""The messages between a Soft Memory Box client and the box server on the box's home host, one TCP connection per
client handle. Both ends are C (csrc/net/wire.c, box_request.c for the client, box_session.c for the server); their
format is the core's header's, and this module packs and reads the headers through the core.

A request is a fixed header, then the box name (create and attach; with FLAG_THEN_TOUCH the box whose version to bump
after the operation), then the elements written, accumulated or exchanged; a reply is a fixed header, then an error
text or the elements read (an exchange's d). A connection carries one operation at a time, each message in one
sendmsg (one segment, one wake-up); a reply that does not come in time means the home host stopped answering."""
import socket

from shmcomm._native import ffi, lib
from shmcomm.vocabulary import exceptions as exc

CREATE, ATTACH, READ, WRITE, ACCUMULATE, LOCK, UNLOCK, WAIT, VERSION, DESTROY, CLOSE, TOUCH, PING, EXCHANGE = (
    lib.SMC_OP_CREATE, lib.SMC_OP_ATTACH, lib.SMC_OP_READ, lib.SMC_OP_WRITE, lib.SMC_OP_ACCUMULATE, lib.SMC_OP_LOCK,
    lib.SMC_OP_UNLOCK, lib.SMC_OP_WAIT, lib.SMC_OP_VERSION, lib.SMC_OP_DESTROY, lib.SMC_OP_CLOSE, lib.SMC_OP_TOUCH,
    lib.SMC_OP_PING, lib.SMC_OP_EXCHANGE)
# PING is the roll call's (rollcall.py), answered at once; WRITE, ACCUMULATE and EXCHANGE carry `count` elements.
FLAG_EXIST_OK, FLAG_THEN_TOUCH, FLAG_STREAM = lib.SMC_FLAG_EXIST_OK, lib.SMC_FLAG_THEN_TOUCH, lib.SMC_FLAG_STREAM
FLAG_STRIPED = lib.SMC_FLAG_STRIPED  # attach's reply: the name belongs to a striped box, whose description came
REQUEST_BYTES, REPLY_BYTES = lib.SMC_REQUEST_BYTES, lib.SMC_REPLY_BYTES


def request(op, flags=0, name_len=0, dtype=0, offset=0, count=0, alpha=0.0, beta=0.0, timeout_s=0.0):
    """A request's header, as bytes: `offset` is a version for WAIT, `name_len` the bytes of the name after it."""
    fields = ffi.new("smc_wire_request_t *", (op, flags, name_len, dtype, offset, count, alpha, beta, timeout_s))
    out = ffi.new("uint8_t[]", REQUEST_BYTES)
    lib.smc_wire_pack_request(out, fields)
    return ffi.buffer(out)[:]


def reply(header):
    """A reply's header (a uint8_t array of REPLY_BYTES, or bytes) as (status, text length, version, count, dtype,
    flags); status 0 is success, else an error text of that length follows, "ClassName\nmessage"."""
    fields = ffi.new("smc_wire_reply_t *")
    lib.smc_wire_parse_reply(header if isinstance(header, ffi.CData) else ffi.from_buffer("uint8_t[]", header), fields)
    return fields.status, fields.text_len, fields.version, fields.count, fields.dtype, fields.flags


# The error classes a reply may name; anything else arrives as ShmCommError.
_ERRORS = {cls.__name__: cls for cls in (exc.InvalidArgumentError, exc.TimeoutError, exc.SystemError,
                                         exc.OutOfMemoryError, exc.BoxExistsError, exc.BoxNotFoundError,
                                         exc.BrokenCommunicatorError, exc.RankFailure, exc.ShmCommError)}


def error_from(class_name, text):
    return _ERRORS.get(class_name, exc.ShmCommError)(text)


def tuned(sock):
    """Small requests go out at once (no Nagle delay); big buffers so that megabytes stream without stalls."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
        except OSError:  # capped by the system: what it allows is fine
            pass
    return sock
