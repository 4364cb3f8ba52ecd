# SPDX-License-Identifier: Apache-2.0
"""Soft Memory Box: named, typed shared buffers that every rank of the job reads, writes and accumulates into.

In a job that spans hosts a box is job-wide: every rank creates or attaches it by name and sees the same elements,
versions and lock. It lives on one home host (`home=`, by default picked from the name; `box.home` says which), or is
striped over `stripes=k` hosts (smb/stripes.py); the home's ranks reach it through shared memory, the others through
its box servers (smb/server.py). `local=True` keeps a box in this host's arena, for its ranks only, with no network.
Boxes live in the job's arena for as long as the job; destroy() gives the name and, once every handle is closed, the
space back."""
import contextlib

import numpy as np

from shmcomm.vocabulary import dtypes
from shmcomm.startup import session
from shmcomm.smb import stripes as smb_stripes
from shmcomm.vocabulary.buffers import wrap
from shmcomm.vocabulary.exceptions import InvalidArgumentError, TimeoutError
from shmcomm.smb.storage import BoxHandle
from shmcomm.smb.rollcall import name_silent_ranks


def _count(shape):
    return int(np.prod(shape, dtype=np.int64))


class SoftMemoryBox:
    """A named, typed buffer that every rank of the job reads, writes and accumulates into, with a version that
    counts its writes and a lock. Updates are atomic against every other writer, on this host and on others.

        box = shmcomm.SoftMemoryBox("weights", shape=(1024,), dtype=np.float32)  # create, or attach if it exists
        box.accumulate(np.ones(1024, np.float32), alpha=-0.01)   # box = box - 0.01 * ones, atomic
        box.wait_version(shmcomm.size(), timeout=5)              # until every rank has written

    Raises BoxExistsError, BoxNotFoundError, OutOfMemoryError (no room left in SHMCOMM_SMB_BYTES or /dev/shm) and,
    across hosts, HostFailure when the box's home host is gone."""

    def __init__(self, name, shape=None, dtype=np.float32, create=None, timeout=None, home=None, stripes=1,
                 local=False):
        """With `shape`: create the box, or attach to an existing one of the same shape and dtype (create=True
        insists on creating). Without: attach to a box another rank creates, waiting up to `timeout` seconds.

        Across hosts: `home` (a host index, 0 .. cross_size-1) places the box, `stripes` spreads it over that many
        hosts from its home; attaching needs the same `home` if one was given, and finds the stripes by itself.

        Args:
            name: the box's name, the same on every rank that shares it.
            shape: an int or a tuple; None attaches to a box another rank creates.
            dtype: a numpy dtype the core reduces (float16/32/64, bfloat16, the integers).
            create: True insists on creating, False on attaching; None (the default) does either.
            timeout: seconds to wait for another rank's box (default SHMCOMM_TIMEOUT).
            home: the host (0 .. cross_size-1) whose memory holds the box.
            stripes: how many hosts, from `home` on, hold a part of it.
            local: a box of this host only, whatever the job spans.

        Raises:
            BoxExistsError: create=True and the box exists. BoxNotFoundError: no rank created it within `timeout`.
            InvalidArgumentError: a shape or dtype unlike the existing box's, a bad home or stripes.
            OutOfMemoryError: no room left in SHMCOMM_SMB_BYTES or /dev/shm. HostFailure: the home host is gone.
        """
        comm = session.communicator()
        job_network = getattr(comm, "box_network", None)
        network = None if local else job_network
        self.name = name
        self._timeout = comm.tuning.timeout_s
        self._roll_call = getattr(job_network, "roll_call", None)  # across hosts (smb/rollcall.py)
        count = code = None
        if shape is not None:
            shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise InvalidArgumentError("box '%s': negative dimension in shape %s" % (name, shape))
            code = dtypes.numpy_code(np.dtype(dtype))
            if code is None:
                raise InvalidArgumentError("box '%s': dtype %s is not supported" % (name, np.dtype(dtype)))
            count = _count(shape)
        wait = comm.tuning.start_timeout_s if timeout is None else float(timeout)
        hosts = network.hosts if network is not None else 1
        here = job_network.host if job_network is not None else 0
        self._check_placement(home, stripes, hosts, local)
        if network is None:
            self.home, self.hosts = here, (here,)
            self._box = (BoxHandle(comm.shm, name, count, code, exist_ok=not create) if count is not None
                         else BoxHandle(comm.shm, name, timeout_s=wait))
        else:
            self.home = smb_stripes.default_home(name, hosts) if home is None else int(home)
            self._box = self._open(comm, network, count, code, not create, int(stripes), wait)
            self.hosts = getattr(self._box, "hosts", (self.home,))
        self.count = self._box.count
        self.shape = shape if shape is not None else (self.count,)
        self.dtype = dtypes.numpy_dtype(self._box.dtype)

    def _check_placement(self, home, stripes, hosts, local):
        if not isinstance(stripes, (int, np.integer)) or isinstance(stripes, bool) or not 1 <= stripes <= hosts:
            raise InvalidArgumentError("box '%s': stripes must be an integer from 1 to the number of hosts (%d), got "
                                       "%r" % (self.name, hosts, stripes))
        if home is not None and (local or not isinstance(home, (int, np.integer)) or isinstance(home, bool)
                                 or not 0 <= home < hosts):
            raise InvalidArgumentError("box '%s': home must be a host index from 0 to %d%s, got %r"
                                       % (self.name, hosts - 1, " and not given with local=True" if local else "",
                                          home))

    def _open(self, comm, network, count, code, exist_ok, stripes, wait):
        if count is not None:
            if stripes > 1:
                return smb_stripes.open_striped(comm, network, self.home, self.name, count, code, stripes, exist_ok)
            return smb_stripes.handle_on(comm, network, self.home, self.name, count, code, exist_ok)
        handle, striped = smb_stripes.find(comm, network, self.home, self.name, wait)
        if not striped:
            return handle
        try:
            return smb_stripes.StripedHandle(comm, network, self.home, self.name, handle, timeout_s=wait)
        except BaseException:
            handle.close()
            raise

    def _handle(self):
        if self._box.closed:
            raise InvalidArgumentError("box '%s' is closed" % self.name)
        if self._box.detached:
            raise InvalidArgumentError("box '%s': shmcomm was shut down" % self.name)
        return self._box

    def _source(self, data, offset, what):
        """`data` as a buffer of the box's dtype. numpy input is converted when numpy calls it safe ("same_kind":
        float64 into a float32 box, not float into an integer box); torch tensors must match exactly."""
        where = "box '%s' %s" % (self.name, what)
        if not hasattr(data, "data_ptr"):
            arr = np.asarray(data)
            if arr.dtype != self.dtype:
                if not np.can_cast(arr.dtype, self.dtype, "same_kind"):
                    raise InvalidArgumentError("%s: got %s, the box holds %s" % (where, arr.dtype, self.dtype))
                arr = arr.astype(self.dtype)
            data = np.ascontiguousarray(arr)
        buf = wrap(data, where)
        if buf.code != self._box.dtype:
            raise InvalidArgumentError("%s: got %s, the box holds %s" % (where, buf.type_name(), self.dtype))
        return buf

    @property
    def version(self):
        """How many writes and accumulates the box has seen."""
        return self._handle().version()

    def view(self):
        """The box's elements as a numpy array over the shared memory itself: no copy, no lock.

        Use it to read a quiet box, or under `locked()`. Only where the box's memory is: on its home host, and not for a
        striped box.

        Returns:
            A numpy array of the box's shape and dtype.

        Raises:
            InvalidArgumentError: the box's memory is on another host, or it is striped (read() copies it).
        """
        raw = self._handle().data(self.count * self.dtype.itemsize)
        return np.frombuffer(raw, dtype=self.dtype).reshape(self.shape)

    def _index(self, value, name, what):
        """An offset or count as the core takes it: a non-negative integer (cffi would raise OverflowError)."""
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise InvalidArgumentError("box '%s' %s: %s must be a non-negative integer, got %r"
                                       % (self.name, what, name, value))
        return int(value)

    def read(self, out=None, offset=0, count=None):
        """A consistent copy of elements [offset, offset+count), taken under the box lock.

        Args:
            out: an array of the box's dtype to copy into (default: a new one).
            offset: the first element to read.
            count: how many elements (default: to the end of the box).

        Returns:
            `out`, or a new array: of the box's shape when the whole box is read, else of `count` elements.

        Raises:
            InvalidArgumentError: a range past the box's end, or an `out` of another dtype or size.
            HostFailure: the box's host is gone (across hosts).
        """
        box = self._handle()
        offset = self._index(offset, "offset", "read")
        count = self._index(max(self.count - offset, 0) if count is None else count, "count", "read")
        if out is None:
            out = np.empty(self.shape if (offset, count) == (0, self.count) else (count,), dtype=self.dtype)
        buf = wrap(out, "box '%s' read" % self.name, writable=True)
        if buf.count < count:
            raise InvalidArgumentError("box '%s' read: out holds %d elements, %d requested" % (self.name, buf.count,
                                                                                              count))
        box.read(offset, count, buf.ptr)
        return out

    def write(self, data, offset=0):
        """Overwrites elements from `offset` with `data`, atomically against every other writer.

        Args:
            data: an array of the box's dtype (any shape: its elements in order).
            offset: the first element of the box to overwrite.

        Returns:
            The box's new version.

        Raises:
            InvalidArgumentError: another dtype, or a range past the box's end; the box stays as it was.
            HostFailure: the box's host is gone (across hosts).
        """
        box = self._handle()
        buf = self._source(data, offset, "write")
        return box.write(self._index(offset, "offset", "write"), buf.count, buf.ptr)

    def accumulate(self, data, alpha=1.0, beta=1.0, offset=0):
        """box = beta * box + alpha * data, atomically against every other writer.

        Args:
            data: as write().
            alpha: multiplies `data`.
            beta: multiplies the box's elements before the sum (1: a plain accumulate).
            offset: the first element of the box to update.

        Returns:
            The box's new version.

        Raises:
            InvalidArgumentError, HostFailure: as write().
        """
        box = self._handle()
        buf = self._source(data, offset, "accumulate")
        return box.accumulate(self._index(offset, "offset", "accumulate"), buf.count, buf.ptr, float(alpha),
                              float(beta))

    def exchange(self, buf, alpha, offset=0):
        """Elastic averaging's exchange in one step, atomic against every other writer.

        With c the box's elements from `offset` and x the contents of `buf`: d = alpha * (x - c) replaces x in `buf`,
        and c += d; the caller then does x -= d. One round trip to a box on another host, where a read and an accumulate
        would take two (ElasticCentre builds on it).

        Args:
            buf: a writable contiguous array of the box's dtype holding x; on return it holds d.
            alpha: the elastic averaging's moving rate.
            offset: the first element of the box to exchange with.

        Returns:
            The box's new version.

        Raises:
            InvalidArgumentError: another dtype, a read-only `buf`, or a range past the box's end.
        """
        box = self._handle()
        out = wrap(buf, "box '%s' exchange" % self.name, writable=True)
        if out.code != self._box.dtype:
            raise InvalidArgumentError("box '%s' exchange: got %s, the box holds %s" % (self.name, out.type_name(),
                                                                                        self.dtype))
        return box.exchange(self._index(offset, "offset", "exchange"), out.count, out.ptr, float(alpha))

    def lock(self, timeout=None):
        """Takes the box's lock, job-wide.

        A rank that dies holding the lock leaves it to the next taker, and the box's version moves on so that readers
        can tell.

        Args:
            timeout: seconds to wait for the lock (default SHMCOMM_TIMEOUT).

        Raises:
            TimeoutError: the lock did not come free in time; the message names the holder.
        """
        try:
            self._handle().lock(self._timeout if timeout is None else float(timeout))
        except TimeoutError as error:  # the holder may itself wait for a rank that is stopped: name those
            name_silent_ranks(error, self._roll_call)
            raise

    def unlock(self):
        """Releases the lock this rank holds.

        Raises:
            InvalidArgumentError: this rank holds no lock on the box.
        """
        self._handle().unlock()

    @contextlib.contextmanager
    def locked(self, timeout=None):
        """A context manager that holds the lock for its block: several operations as one.

        Args:
            timeout: as lock().

        Example:
                with box.locked():
                    snapshot = box.read()
        """
        self.lock(timeout)
        try:
            yield self
        finally:
            self.unlock()

    def wait_version(self, version, timeout=None):
        """Sleeps until the box's version reaches `version`.

        Args:
            version: the version to wait for (box.version + k waits for k more updates).
            timeout: seconds (default SHMCOMM_TIMEOUT).

        Returns:
            The version seen, at least `version`.

        Raises:
            TimeoutError: the version did not come in time.
        """
        return self._handle().wait_version(int(version), self._timeout if timeout is None else float(timeout))

    def close(self):
        """Detaches this rank from the box; the box and its contents stay for the others."""
        self._box.close()

    def destroy(self):
        """Removes the name; the space is reused once every rank has closed its handle."""
        self._box.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return "SoftMemoryBox(%r, shape=%s, dtype=%s, hosts=%s)" % (self.name, self.shape, self.dtype, self.hosts)
