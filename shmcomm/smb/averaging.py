# SPDX-License-Identifier: Apache-2.0
"""Elastic averaging (EASGD, Zhang, Choromanska and LeCun 2015) over a job-wide Soft Memory Box, as ShmCaffe trains:
the building blocks any framework uses (shmcomm.torch.ElasticAveragingOptimizer is one user).

Each worker steps on its own and, every few steps, exchanges with the centre c held in the box without waiting for any
other worker: d = alpha * (x - c); x -= d; c += d, where the read of c and c += d are one atomic box exchange (one round
trip to each host of the centre, with nobody's update in between). In the hybrid mode the ranks of a host average their
gradients synchronously and one rank per host exchanges for the host, then broadcasts to it (see host_process_set)."""
import concurrent.futures
import itertools

import numpy as np

from shmcomm import process_sets
from shmcomm.startup import session
from shmcomm.vocabulary.exceptions import InvalidArgumentError
from shmcomm.smb.box import SoftMemoryBox


class ElasticCentre:
    """The centre variable of elastic averaging (EASGD), held in a job-wide Soft Memory Box.

    With overlap, each exchange is sent from a background thread while the caller computes (ShmCaffe's update thread):
    the exchange takes a copy of x, and the d it brings back is subtracted from x at the next exchange (or flush), so
    the worker's pull lands one exchange late. In line, an exchange then costs a copy of x and a subtraction.

    Args:
        name: the box's name, the same on every rank.
        count: the number of elements of the centre (the flattened parameters).
        dtype: the parameters' numpy dtype.
        home, stripes: where the box lives across hosts, as for SoftMemoryBox.
        overlap: exchange from a background thread (True) or in line (False).

    Raises:
        ShmCommError: as SoftMemoryBox's constructor.

    Example:
            centre = ElasticCentre("centre", x.size)      # every rank; job-wide box
            if shmcomm.rank() == 0:
                centre.initialise(x)                       # the others wait for it in ready()
            centre.ready()
            for step in ...:
                ...local SGD step on x...
                if step % period == 0:
                    centre.exchange(x, alpha=0.2)
            centre.flush(); centre.pull()                  # the centre, for evaluation
    """

    def __init__(self, name, count, dtype=np.float32, home=None, stripes=1, overlap=True):
        self.box = SoftMemoryBox(name, shape=(int(count),), dtype=dtype, home=home, stripes=stripes)
        self.name = name
        self.dtype = self.box.dtype
        self.count = self.box.count
        self._sent = np.empty(self.count, dtype=self.dtype)  # x as sent, then d as it comes back
        self._pusher = None
        self._pending = None  # (the exchange in flight, the x that its d is for)
        if overlap:
            self._pusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shmcomm-elastic")

    def initialise(self, x):
        """Sets the centre to `x`; one rank does it, and the centre is ready from then on.

        Args:
            x: a contiguous numpy array of `count` elements of the centre's dtype.

        Raises:
            InvalidArgumentError: another dtype, size or layout.
        """
        self.box.write(self._checked(x, "initialise"))

    def ready(self, timeout=None):
        """Waits until some rank has initialised the centre.

        Args:
            timeout: seconds (default SHMCOMM_TIMEOUT).

        Raises:
            TimeoutError: no rank initialised it in time.
        """
        self.box.wait_version(1, timeout)

    def pull(self, out=None):
        """A copy of the centre, taken under the box's lock.

        Args:
            out: an array of `count` elements of the centre's dtype to copy into (default: a new one).

        Returns:
            `out`, or a new array, holding the centre.
        """
        return self.box.read(out=out)

    def _checked(self, x, what):
        if not isinstance(x, np.ndarray) or x.dtype != self.dtype or x.size != self.count or not x.flags.c_contiguous:
            raise InvalidArgumentError("elastic centre '%s' %s: expected a contiguous numpy array of %d %s, got %s"
                                       % (self.name, what, self.count, self.dtype,
                                          "%s of %s" % (x.shape, x.dtype) if isinstance(x, np.ndarray) else type(x)))
        return x

    def exchange(self, x, alpha):
        """One elastic-averaging exchange: x -= alpha * (x - c) in place, and c += alpha * (x - c) atomically in the
        box.

        With overlap, this exchange's d reaches x at the next exchange or flush, and the previous one's lands now.

        Args:
            x: this rank's parameters, a contiguous numpy array of `count` elements of the centre's dtype.
            alpha: the moving rate, in (0, 1].

        Returns:
            The box's new version in line; None with overlap (the exchange is still in flight).

        Raises:
            InvalidArgumentError: another dtype, size or layout, or alpha outside (0, 1].
            ShmCommError: with overlap, the previous exchange's error.
        """
        self._checked(x, "exchange")
        if not 0.0 < alpha <= 1.0:
            raise InvalidArgumentError("elastic centre '%s': alpha must be in (0, 1], got %r" % (self.name, alpha))
        self.flush()  # one exchange in flight at most, and its d applied
        np.copyto(self._sent, x)
        if self._pusher is None:
            version = self.box.exchange(self._sent, alpha)
            x -= self._sent
            return version
        self._pending = (self._pusher.submit(self.box.exchange, self._sent, alpha), x)
        return None

    def flush(self):
        """Waits for the exchange in flight, if any, and applies its d to its x; raises what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            future, x = pending
            future.result()
            x -= self._sent

    def close(self):
        """Waits for the exchange in flight (flush) and stops the background thread that runs them."""
        try:
            self.flush()
        finally:
            if self._pusher is not None:
                self._pusher.shutdown(wait=True)
                self._pusher = None
            self.box.close()


def host_process_set():
    """The process set of this host's ranks (the global set where the job has one host). Every rank calls it at the
    same point: it registers one set per host, in host order."""
    comm = session.communicator()
    groups = comm.host_groups
    if len(groups) == 1:
        return process_sets.global_process_set
    known = _host_sets.get(session.generation())
    if known is not None and known.process_set_id is not None:
        return known
    mine = None
    me = comm.topology.rank
    for group in groups:
        ps = process_sets.add_process_set(group)
        if me in group:
            mine = ps
    comm.barrier()  # no rank uses its set before every member has registered it
    _host_sets.clear()
    _host_sets[session.generation()] = mine
    return mine


_host_sets = {}  # this session's host set, once made


_names = itertools.count()


def next_name(prefix):
    """A box name that every rank derives alike when every rank creates the same objects in the same order."""
    return "%s%d" % (prefix, next(_names))
