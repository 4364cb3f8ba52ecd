# SPDX-License-Identifier: Apache-2.0
"""The background engine: asynchronous collectives, negotiated across ranks, fused, in one order everywhere.

It starts on the first asynchronous request (basics.start_engine hands it the world communicator) and stops at
shutdown (basics.shutdown stops it first)."""
import threading

from shmcomm.startup import session

_lock = threading.Lock()
_engine = None


def current():
    """The running engine, or None."""
    return _engine


def start(comm, communicator_of):
    """The running engine, started on `comm` if needed; communicator_of(set_id) is a process set's communicator."""
    global _engine
    with _lock:
        if _engine is None:
            from shmcomm.engine.loop import Engine

            _engine = Engine(comm, communicator_of)
            started = True
        else:
            started = False
    if started:
        session.changed()
    return _engine


def stop():
    global _engine
    with _lock:
        engine, _engine = _engine, None
    if engine is not None:
        engine.stop()
        session.changed()
