# SPDX-License-Identifier: Apache-2.0
"""What a caller asks for (Request), how it finds out when it is done (Handle), and how one request runs."""
import threading
import time

from shmcomm.vocabulary.exceptions import InvalidArgumentError


class Request:
    """One collective on one tensor. `root` is an index in `comm`; `splits` is a list of rows per rank."""

    __slots__ = ("kind", "name", "tensor", "output", "op", "prescale", "postscale", "root", "splits", "comm",
                 "set_id", "handle", "submitted", "want_splits", "buffer", "error", "ready")

    def __init__(self, kind, name, tensor, comm, set_id=0, output=None, op=None, prescale=1.0, postscale=1.0, root=0,
                 splits=None):
        self.kind = kind
        self.name = name
        self.tensor = tensor
        self.output = output
        self.op = op
        self.prescale = float(prescale)
        self.postscale = float(postscale)
        self.root = root
        self.splits = splits
        self.comm = comm
        self.set_id = set_id
        self.handle = None
        self.submitted = 0.0
        self.buffer = None  # the engine's view of `tensor`, made once at submission
        self.want_splits = False  # alltoall: return the received splits too (Horovod does when splits were given)
        self.error = None  # a check of the arguments that failed on this rank (checked())
        self.ready = None  # CUDA tensors: what algorithms/device.py recorded at submission (the caller's stream)

    def checked(self, check, *args, default=None):
        """check(*args), or `default` if it raises InvalidArgumentError: the error then travels with the request
        (`error`), so that it is raised where the other ranks can be told of it (execute(), the engine's submit)
        instead of leaving them waiting in the collective for this rank."""
        try:
            return check(*args)
        except InvalidArgumentError as error:
            if self.error is None:
                self.error = error
            return default

    @property
    def what(self):
        """How error messages name it: the request name, which starts with the collective's."""
        return self.kind if self.name is None else self.name


def execute(req):
    """Runs `req` on its communicator, now, in this thread. A failure of this rank's own checks fails the
    collective on every rank at once (Communicator.refused)."""
    try:
        if req.error is not None:
            raise req.error
        return _dispatch(req)
    except InvalidArgumentError as error:
        raise req.comm.refused(req.kind, error, req.what) from None


def _dispatch(req):
    kind, comm, what = req.kind, req.comm, req.what
    if getattr(comm, "on_device", False):  # CUDA tensors (algorithms/device.py) read the whole request
        return comm.run(req)
    if kind == "allreduce":
        return comm.allreduce(req.tensor, req.output, req.op, req.prescale, req.postscale, what)
    if kind == "broadcast":
        return comm.broadcast(req.tensor, req.output, req.root, what)
    if kind == "allgather":
        return comm.allgather(req.tensor, what, req.output)
    if kind == "reducescatter":
        return comm.reducescatter(req.tensor, req.op, req.prescale, req.postscale, what, req.output)
    if kind == "alltoall":
        return comm.alltoall(req.tensor, req.splits, what, req.output)
    if kind == "barrier":
        return comm.barrier(what)
    raise ValueError("unknown collective %r" % kind)


# One condition for every handle: completing a fused group of a hundred tensors then costs one wake-up, not a
# hundred Event objects' worth.
_completed = threading.Condition(threading.Lock())
_WAKE_S = 0.1  # how often a caller waiting for a handle wakes to run signal handlers


class Handle:
    """The caller's side of a submitted request: poll() without blocking, wait() for the result or the error."""

    __slots__ = ("request", "done", "_result", "_error", "finished", "_callbacks", "wake")

    def __init__(self, request):
        self.request = request
        self.done = False
        self._result = None
        self._error = None
        self.finished = 0.0
        self._callbacks = None
        self.wake = None  # the engine's flush: asking about a result makes the engine negotiate now

    def add_done_callback(self, fn):
        """Calls fn(handle) once done, at once if it is already; from the engine's thread otherwise. fn must be quick
        and must not wait for other collectives."""
        with _completed:
            pending = not self.done
            if pending:
                self._callbacks = (self._callbacks or []) + [fn]
        if not pending:
            fn(self)
        elif self.wake is not None:
            self.wake()  # someone waits for the result, if not in this thread

    def poll(self):
        if not self.done and self.wake is not None:
            self.wake()
        return self.done

    def wait(self, timeout=None):
        if not self.done:
            if self.wake is not None:
                self.wake()
            deadline = None if timeout is None else time.monotonic() + timeout
            with _completed:
                # In slices: a signal that lands on another thread runs its handler (Ctrl-C's KeyboardInterrupt)
                # only once this thread wakes, and a wait without a bound would never wake for it.
                while not self.done:
                    left = _WAKE_S if deadline is None else min(_WAKE_S, deadline - time.monotonic())
                    if left <= 0:
                        from shmcomm.vocabulary.exceptions import TimeoutError

                        what = self.request.what if self.request is not None else "join"
                        raise TimeoutError("%s: not done after %.1f s" % (what, timeout))
                    _completed.wait(left)
        if self._error is not None:
            raise self._error
        return self._result

    def set_result(self, result):
        finish([(self, result, None)])

    def set_error(self, error):
        finish([(self, None, error)])


def finish(outcomes):
    """Completes [(handle, result, error)] at once and wakes the waiters once."""
    now = time.monotonic()
    callbacks = []
    with _completed:
        for handle, result, error in outcomes:
            handle._result, handle._error, handle.finished = result, error, now
            if handle.request is not None:
                # The request and its handle point at each other until now: undone, the pair would be cyclic
                # garbage, and keep the result alive until the collector's next full pass.
                handle.request.handle = None
                if error is None:
                    handle.request.tensor = handle.request.buffer = None  # the caller holds what it needs
            handle.done = True
            if handle._callbacks:
                callbacks.append(handle)
        _completed.notify_all()
    for handle in callbacks:
        for fn in handle._callbacks:
            fn(handle)
