# SPDX-License-Identifier: Apache-2.0
"""The background engine: asynchronous collectives, negotiated across ranks, fused, in one order everywhere.

It starts on the first asynchronous request and stops at shutdown (basics.shutdown stops it first)."""
import threading

_lock = threading.Lock()
_engine = None


def current():
    """The running engine, or None."""
    return _engine


def start():
    """The running engine, started if needed (needs init())."""
    global _engine
    with _lock:
        if _engine is None:
            from shmcomm import basics
            from shmcomm.engine.loop import Engine

            comm = basics.communicator()
            _engine = Engine(comm)
        return _engine


def stop():
    global _engine
    with _lock:
        engine, _engine = _engine, None
    if engine is not None:
        engine.stop()
