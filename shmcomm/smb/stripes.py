# SPDX-License-Identifier: Apache-2.0
"""Where a job-wide Soft Memory Box lives, and boxes striped over several hosts (SMB2's several memory servers).

A box has a home host, in whose arena it is: that host's ranks reach it through shared memory (smb/storage.py), the
other hosts' ranks through the home's box servers (smb/client.py). A box of `stripes=k` is k boxes, `name@0` ..
`name@{k-1}`, of about count/k elements each, stripe j on host (home + j) % hosts, described by a small box
`name@stripes` at home holding [count, dtype, k] (StripedHandle)."""
import zlib

import numpy as np

from shmcomm.vocabulary import dtypes
from shmcomm._native import ffi
from shmcomm.vocabulary.exceptions import BoxExistsError, InvalidArgumentError
from shmcomm.transport import kernels
from shmcomm.smb.storage import STRIPED_SUFFIX, BoxHandle, find_box, stripe_name
from shmcomm.smb.client import RemoteBoxHandle


# Below this many bytes of a striped operation on this host's own stripes, they are done before the home stripe's
# request leaves, so that it can carry the version bump (StripedHandle._each).
_SEQUENTIAL_BYTES = 64 << 10


def default_home(name, hosts):
    """The home of a box nobody placed: the same on every rank, spread over the hosts by name."""
    return zlib.crc32(name.encode()) % hosts


def handle_on(comm, network, host, name, count=None, dtype=None, exist_ok=True, timeout_s=0.0):
    """A handle to the box `name` whose home is `host`: in this host's arena, or through the home's box server."""
    if host == network.host:
        if count is None:
            return BoxHandle(comm.shm, name, timeout_s=timeout_s)
        return BoxHandle(comm.shm, name, count, dtype, exist_ok)
    return RemoteBoxHandle(network, host, name, count, dtype, exist_ok, timeout_s)


def find(comm, network, home, name, timeout_s):
    """(handle, striped): the box `name` at `home`, or the description of the striped box of that name."""
    if home == network.host:
        return find_box(comm.shm, name, timeout_s)
    handle = RemoteBoxHandle(network, home, name, timeout_s=timeout_s)
    return handle, handle.striped


class StripedHandle:
    """box.BoxHandle's interface over the stripes of one box. Its version and its lock are the description's: every
    write and accumulate bumps the description once its stripes are done, and lock() takes the description's lock and
    then every stripe's, in order, so that it excludes every writer of every stripe (each of which takes its stripe's
    lock) and two lockers never wait for each other crosswise."""

    def __init__(self, comm, network, home, name, description, count=None, dtype=None, stripes=None, timeout_s=0.0):
        """`description`: the handle to `name@stripes` (created here when `count` is given, else found)."""
        self._description = description
        self._name = name
        self._held = 0  # how many times this handle holds the box's lock (lock() is recursive as a box's is)
        if count is not None:
            done = [count, dtype, stripes]
            if description.version() != 0:  # another rank created it: it must describe the same box
                self._check_same(done, timeout_s)
        else:
            done = self._described(timeout_s)
        self.count, self.dtype, self.stripes = done
        self.esize = kernels.itemsize(self.dtype)
        self.size = -(-self.count // self.stripes) if self.stripes else 0
        self.hosts = tuple((home + j) % network.hosts for j in range(self.stripes))
        self._parts = []
        try:
            for j, host in enumerate(self.hosts):
                part = min(self.size, max(self.count - j * self.size, 0))
                self._parts.append(handle_on(comm, network, host, stripe_name(name, j), part, self.dtype))
        except BaseException:
            self.close()
            raise
        if count is not None:
            self._publish(done, timeout_s)

    def _publish(self, done, timeout_s):
        """Writes the description, once: the check and the write are one step under the description's lock, for
        ranks that create the box at once would otherwise both write it, making version 2, which every rank takes
        for the box's first write (an initialising write could then land after, and erase, another rank's
        accumulate)."""
        self._description.lock(timeout_s)
        try:
            if self._description.version() == 0:
                self._description.write(0, 3, ffi.from_buffer(np.array(done, dtype=np.int64)))  # version 1: ready
                return
        finally:
            self._description.unlock()
        self._check_same(done, timeout_s)

    def _check_same(self, done, timeout_s):
        there = self._described(timeout_s)
        if there != done:
            raise BoxExistsError("box '%s' exists with %d elements of dtype %d in %d stripes, not %d of dtype %d in "
                                 "%d" % (self._name, *there, *done))

    def _described(self, timeout_s):
        self._description.wait_version(1, timeout_s)
        out = np.zeros(3, dtype=np.int64)
        self._description.read(0, 3, ffi.from_buffer(out))
        return [int(v) for v in out]

    closed = property(lambda self: self._description is None)
    detached = property(lambda self: any(p.detached for p in self._parts))

    def _spans(self, offset, count, ptr):
        """(stripe, offset in it, count, pointer) of each stripe that [offset, offset+count) touches."""
        end = offset + count
        if offset > self.count or end > self.count:
            raise InvalidArgumentError("box '%s': elements [%d, %d) are outside the box of %d elements"
                                       % (self._name, offset, end, self.count))
        at = ffi.cast("char *", ptr) if count else ffi.NULL
        for j, part in enumerate(self._parts):
            lo, hi = max(offset, j * self.size), min(end, (j + 1) * self.size)
            if lo < hi:
                yield part, lo - j * self.size, hi - lo, at + (lo - offset) * self.esize

    def version(self):
        return self._description.version() - 1  # the description's own write was version 1

    def data(self, nbytes):
        raise InvalidArgumentError("box '%s' is striped over hosts %s: view() needs the whole box on this host; "
                                   "read() copies it here" % (self._name, ", ".join(map(str, self.hosts))))

    def _each(self, op, offset, count, ptr, alpha=1.0, beta=1.0):
        """`op` on every stripe the span touches, then (but for a read) the description's version bumped: the
        requests to other hosts leave first, this host's stripes are done while they travel, then their replies are
        collected, so that the hosts serve the stripes at once. Returns the box's new version (None for a read).

        The bump must come after every stripe is done. Where the home stripe (and the description with it) is on
        another host and this host's part is small, this host's stripes go first and the home stripe's request
        carries the bump (FLAG_THEN_TOUCH): one round trip instead of two, which is most of the cost of a small
        exchange. A big local part is worth overlapping with the transfer instead, and then the bump follows on its
        own; so does it while this handle holds the box's lock, whose description part belongs to the description's
        connection (the home stripe's server thread would wait for it)."""
        spans = list(self._spans(offset, count, ptr))
        home = self._parts[0]
        local_bytes = sum(n for part, _, n, _ in spans if not hasattr(part, "start")) * self.esize
        last = None
        if op != "read" and hasattr(home, "start") and local_bytes <= _SEQUENTIAL_BYTES and not self._held:
            last = next((span for span in spans if span[0] is home), (home, 0, 0, ffi.NULL))
            spans = [span for span in spans if span[0] is not home]
        pending, version = [], None
        try:
            for part, at, n, at_ptr in spans:
                if hasattr(part, "start"):
                    pending.append(part.start(op, at, n, at_ptr, alpha, beta))
            for part, at, n, at_ptr in spans:
                if not hasattr(part, "start"):
                    _apply(part, op, at, n, at_ptr, alpha, beta)
        finally:
            errors = []
            for finish in pending:  # every reply is collected, even after a failure, or the connections jam
                try:
                    finish()
                except Exception as error:
                    errors.append(error)
            if errors:
                raise errors[0]
        if last is not None:
            part, at, n, at_ptr = last
            version = part.start(op, at, n, at_ptr, alpha, beta, then_touch=self._name + STRIPED_SUFFIX)()
        elif op != "read":
            version = self._description.touch()
        return None if version is None else version - 1  # the description's own write was version 1

    def read(self, offset, count, dst):
        self._each("read", offset, count, dst)

    def write(self, offset, count, src):
        return self._each("write", offset, count, src)

    def accumulate(self, offset, count, src, alpha, beta):
        return self._each("accumulate", offset, count, src, alpha, beta)

    def exchange(self, offset, count, x_to_d, alpha):
        """Each stripe's exchange is atomic; the stripes are not one atomic step together (nor are accumulates)."""
        return self._each("exchange", offset, count, x_to_d, alpha)

    def touch(self):
        return self._description.touch() - 1

    def lock(self, timeout_s):
        taken = []
        try:
            for handle in [self._description] + self._parts:
                handle.lock(timeout_s)
                taken.append(handle)
        except BaseException:
            for handle in reversed(taken):
                handle.unlock()
            raise
        self._held += 1

    def unlock(self):
        for handle in reversed([self._description] + self._parts):
            handle.unlock()
        self._held -= 1

    def wait_version(self, version, timeout_s):
        return self._description.wait_version(version + 1, timeout_s) - 1

    def close(self):
        for part in self._parts:
            part.close()
        if self._description is not None:
            self._description.close()
            self._description = None

    def destroy(self):
        for part in self._parts:
            part.destroy()
        self._parts = []
        description, self._description = self._description, None
        description.destroy()


def _apply(handle, op, offset, count, ptr, alpha, beta):
    if op == "read":
        handle.read(offset, count, ptr)
    elif op == "write":
        handle.write(offset, count, ptr)
    elif op == "accumulate":
        handle.accumulate(offset, count, ptr, alpha, beta)
    else:
        handle.exchange(offset, count, ptr, alpha)


def open_striped(comm, network, home, name, count, dtype, stripes, exist_ok):
    description = handle_on(comm, network, home, name + STRIPED_SUFFIX, 3, dtypes.numpy_code(np.dtype(np.int64)),
                            exist_ok)
    try:
        return StripedHandle(comm, network, home, name, description, count, dtype, stripes,
                             timeout_s=network.timeout_s)
    except BaseException:
        description.close()
        raise
