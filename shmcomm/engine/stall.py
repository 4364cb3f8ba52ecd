# SPDX-License-Identifier: Apache-2.0
"""Stall inspector: says, on the ranks that are waiting, which tensors they wait for and which ranks never sent them.

Every rank sees every rank's pending list each cycle, so no coordinator is needed: a rank that has a tensor pending
for longer than the warning time prints what it waits for and on whom. After the shutdown time (0 = never), the
waiting requests fail instead of hanging."""
import sys
import time


class StallInspector:
    def __init__(self, rank, warning_s=60.0, shutdown_s=0.0, enabled=True, stream=None):
        self.rank = rank
        self.warning_s = warning_s
        self.shutdown_s = shutdown_s
        self.enabled = enabled
        self.stream = stream  # None: whatever sys.stderr is when there is something to say
        self._since = {}      # name -> when it was first seen waiting
        self._warned = {}     # name -> when we last warned about it

    def check(self, waiting, now=None):
        """`waiting`: {name: (ranks that submitted, ranks missing)}. Returns {name: message} of requests this rank
        should fail because they waited past the shutdown time."""
        if not self.enabled:
            return {}
        now = time.monotonic() if now is None else now
        for name in list(self._since):
            if name not in waiting:
                del self._since[name]
                self._warned.pop(name, None)
        stalled, to_fail = {}, {}
        for name, (have, missing) in waiting.items():
            since = self._since.setdefault(name, now)
            if self.rank not in have or now - since < self.warning_s:
                continue
            if now - self._warned.get(name, 0.0) >= self.warning_s:
                stalled[name] = (since, missing)
            if self.shutdown_s > 0 and now - since >= self.shutdown_s:
                to_fail[name] = ("%s: gave up after %.0f s: ranks %s never submitted it (stall shutdown time)"
                                 % (name, now - since, ", ".join(str(r) for r in missing)))
        if stalled:
            self._report(stalled, now)
        return to_fail

    def _report(self, stalled, now):
        by_rank = {}
        for name, (since, missing) in stalled.items():
            self._warned[name] = now
            for r in missing:
                by_rank.setdefault(r, []).append("%s (%.0f s)" % (name, now - since))
        lines = ["shmcomm stall warning on rank %d: waiting for tensors that other ranks have not submitted:"
                 % self.rank]
        for r in sorted(by_rank):
            lines.append("    rank %d has not submitted: %s" % (r, ", ".join(sorted(by_rank[r]))))
        lines.append("    Ranks must submit the same tensors (by name). A rank that ran out of data should call "
                     "join(); a rank stuck in other work shows up here too.")
        stream = self.stream or sys.stderr
        stream.write("\n".join(lines) + "\n")
        stream.flush()
