# SPDX-License-Identifier: Apache-2.0
"""The messages between a Soft Memory Box client and the box server on the box's home host, one TCP connection per
client handle. Both ends are C (csrc/net/wire.c, box_request.c for the client, box_session.c for the server); their
format is declared in the core's header, and this module packs and reads the headers in the layout read from it.

A request is a fixed header, then the box name (create and attach; with FLAG_THEN_TOUCH the box whose version to bump
after the operation), then the elements written, accumulated or exchanged; a reply is a fixed header, then an error
text or the elements read (an exchange's d). A connection carries one operation at a time, each message in one
sendmsg (one segment, one wake-up); a reply that does not come in time means the home host stopped answering."""
import socket
import struct

from shmcomm._native import ffi, lib
from shmcomm.vocabulary import exceptions as exc

CREATE, ATTACH, READ, WRITE, ACCUMULATE, LOCK, UNLOCK, WAIT, VERSION, DESTROY, CLOSE, TOUCH, PING, EXCHANGE = (
    lib.SMC_OP_CREATE, lib.SMC_OP_ATTACH, lib.SMC_OP_READ, lib.SMC_OP_WRITE, lib.SMC_OP_ACCUMULATE, lib.SMC_OP_LOCK,
    lib.SMC_OP_UNLOCK, lib.SMC_OP_WAIT, lib.SMC_OP_VERSION, lib.SMC_OP_DESTROY, lib.SMC_OP_CLOSE, lib.SMC_OP_TOUCH,
    lib.SMC_OP_PING, lib.SMC_OP_EXCHANGE)
# PING is the roll call's (rollcall.py), answered at once; WRITE, ACCUMULATE and EXCHANGE carry `count` elements.
FLAG_EXIST_OK, FLAG_THEN_TOUCH, FLAG_STREAM = lib.SMC_FLAG_EXIST_OK, lib.SMC_FLAG_THEN_TOUCH, lib.SMC_FLAG_STREAM
FLAG_STRIPED = lib.SMC_FLAG_STRIPED  # attach's reply: the name belongs to a striped box, whose description came


def _layout(ctype):
    """struct's little-endian format for a header, from the core's declaration of it: its fields in order, each at the
    offset C gives it (the wire's layout is the struct's own, without padding)."""
    codes = {"uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "int32_t": "i", "uint64_t": "Q", "double": "d"}
    layout, at = "<", 0
    for _, field in ffi.typeof(ctype).fields:
        if field.offset != at:
            raise ImportError("%s has padding at byte %d: the wire's layout is not its own" % (ctype, at))
        layout += codes[field.type.cname]
        at += ffi.sizeof(field.type)
    return struct.Struct(layout)


# op, flags, name length, dtype, offset (or a version), count, alpha, beta, timeout in seconds
REQUEST = _layout("smc_wire_request_t")
# status (0: success, else the error's class follows as text), text length, version, count, dtype, flags
REPLY = _layout("smc_wire_reply_t")
if (REQUEST.size, REPLY.size) != (lib.SMC_REQUEST_BYTES, lib.SMC_REPLY_BYTES):
    raise ImportError("the wire's headers are %d and %d bytes, not the core's" % (REQUEST.size, REPLY.size))


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
