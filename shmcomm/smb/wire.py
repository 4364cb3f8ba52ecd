# SPDX-License-Identifier: Apache-2.0
"""The messages between a Soft Memory Box client and the box server on the box's home host, one TCP connection per
client handle. Both ends are C (csrc/net/wire.c, box_request.c for the client, box_session.c for the server); this
module packs and unpacks the headers.

A request is a fixed header (REQUEST), then the box name (create and attach; with FLAG_THEN_TOUCH the box whose version
to bump after the operation), then the elements written, accumulated or exchanged; a reply is a fixed header (REPLY),
then an error text or the elements read (an exchange's d). A connection carries one operation at a time, each message
in one sendmsg (one segment, one wake-up); a reply that does not come in time means the home host stopped answering."""
import socket
import struct

from shmcomm.vocabulary import exceptions as exc

# op, flags, name length, dtype, offset (or a version), count, alpha, beta, timeout in seconds
REQUEST = struct.Struct("<BBHIQQddd")
# status (0: success, else the error's class follows as text), text length, version, count, dtype, flags
REPLY = struct.Struct("<iIQQII")

CREATE, ATTACH, READ, WRITE, ACCUMULATE, LOCK, UNLOCK, WAIT, VERSION, DESTROY, CLOSE, TOUCH, PING, EXCHANGE = \
    range(1, 15)
# PING is the roll call's (rollcall.py), answered at once; WRITE, ACCUMULATE and EXCHANGE carry `count` elements.
FLAG_EXIST_OK = 1   # create: attach to an equal box instead of failing
FLAG_THEN_TOUCH = 2  # write, accumulate, exchange: then bump the version of the named box; the reply carries it
FLAG_STREAM = 4     # exchange: d comes back in parts while x still goes (csrc/net/wire.h says how)
FLAG_STRIPED = 1    # attach's reply: the name belongs to a striped box; its description was found instead

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
