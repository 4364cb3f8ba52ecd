# SPDX-License-Identifier: Apache-2.0
"""Chrome-trace timeline of what the engine did with each tensor (open it in Perfetto or chrome://tracing).

Each tensor is a trace "process" named after it; its phases are begin/end events: NEGOTIATE_<OP> from submission to
agreement, then the op itself with MEMCPY_IN_FUSION_BUFFER, ALLREDUCE and MEMCPY_OUT_FUSION_BUFFER when fused.
With mark_cycles, every engine cycle is an instant CYCLE_START event. The file is readable while the job runs, as
Horovod's is: the trace format allows an array that is not closed yet."""
import json
import os
import threading
import time

_FLUSH_S = 0.05  # cycle marks reach the file at most this long after they happen (plus one idle engine cycle)


class Timeline:
    """One rank's trace file. The end of each phase is flushed at once, so that a finished collective is in the file
    when its caller returns (one write per phase, from the engine's thread); cycle marks alone wait for the engine's
    next cycle after _FLUSH_S, so that a busy engine does not write once per cycle. stop() leaves a closed array,
    synced to the disk."""

    def __init__(self, rank):
        self.rank = rank
        self._file = None
        self._lock = threading.Lock()
        self._ids = {}
        self._t0 = 0.0
        self._unflushed = False
        self._flushed_at = 0.0
        self.mark_cycles = False

    @property
    def active(self):
        return self._file is not None

    def start(self, path, mark_cycles=False):
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = open(path, "w")
            self._ids = {}
            self._t0 = time.monotonic()
            self.mark_cycles = mark_cycles
            self._file.write("[\n")
            self._emit({"name": "process_name", "ph": "M", "pid": 0, "args": {
                "name": "shmcomm rank %d" % self.rank,
                "start_time_since_epoch_in_micros": int(time.time() * 1e6)}})

    def stop(self):
        with self._lock:
            if self._file is not None:
                # The last event carries no comma so that the file is one valid JSON array.
                self._file.write(json.dumps({"name": "timeline_end", "ph": "i", "s": "g", "pid": 0,
                                             "ts": self._now()}) + "\n]\n")
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None

    def _now(self):
        return int((time.monotonic() - self._t0) * 1e6)

    def _emit(self, event):
        self._file.write(json.dumps(event) + ",\n")
        self._unflushed = True

    def _pid(self, name):
        pid = self._ids.get(name)
        if pid is None:
            pid = self._ids[name] = len(self._ids) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        return pid

    def _phase(self, names, phase, ph, args=None):
        if self._file is None:
            return
        with self._lock:
            if self._file is None:
                return
            ts = self._now()
            for name in names:
                event = {"name": phase, "ph": ph, "ts": ts, "pid": self._pid(name), "tid": 0}
                if args:
                    event["args"] = args
                self._emit(event)
            if ph == "E":
                self._flush(time.monotonic())

    def _flush(self, now):
        self._file.flush()
        self._unflushed, self._flushed_at = False, now

    def begin(self, names, phase, args=None):
        self._phase(names, phase, "B", args)

    def end(self, names, phase):
        """Ends `phase` of each tensor in `names`; what was written so far reaches the file before this returns."""
        self._phase(names, phase, "E")

    def cycle(self):
        """Once per engine cycle: the cycle's mark, and a flush once _FLUSH_S has passed since the last one."""
        if self._file is None:
            return
        with self._lock:
            if self._file is None:
                return
            if self.mark_cycles:
                self._emit({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "ts": self._now()})
            now = time.monotonic()
            if self._unflushed and now - self._flushed_at >= _FLUSH_S:
                self._flush(now)


def started(rank, path, mark_cycles):
    """A timeline writing to `path` (env.timeline(): SHMCOMM_TIMELINE), if one is given; a path with {rank} gets the
    rank, and other ranks than 0 write `<path>.<rank>` so that ranks never share a file."""
    timeline = Timeline(rank)
    if path and path != "DYNAMIC":
        path = path.format(rank=rank) if "{rank}" in path else (path if rank == 0 else "%s.%d" % (path, rank))
        timeline.start(path, mark_cycles)
    return timeline
