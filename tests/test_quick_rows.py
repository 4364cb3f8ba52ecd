# SPDX-License-Identifier: Apache-2.0
"""The quick calls of allgather, alltoall and reducescatter (csrc/py/quick_calls.c: one C call that works out the tag,
the counts and the result's shape itself), beside allreduce's and broadcast's: repeated calls of every collective give
the right results, into new arrays, outputs and in place, without wrapping the arrays or taking a step from Python;
a rank without the quick calls and ranks with them agree on what they pass the core; results whose shape changes
with the peers' rows; an array the quick calls must not take (non-contiguous, read-only, another byte order, an output
of another dtype or shape) gets the full path's checks and errors, on every rank, and the job goes on."""
import numpy as np
import pytest

import multiproc

FAST_TIMEOUT = {"SHMCOMM_TIMEOUT": "20"}


def _expected(size, me, step):
    """(this rank's input, the allreduce sum, the allgather, this rank's reducescatter share, alltoall's input and
    result) of step `step`: values that change every step, so a stale result cannot pass."""
    x = np.arange(size * 6, dtype=np.float32).reshape(size * 2, 3) + 10 * me + step
    total = sum(np.arange(size * 6, dtype=np.float32).reshape(size * 2, 3) + 10 * r + step for r in range(size))
    gathered = np.concatenate([np.arange(size * 6, dtype=np.float32).reshape(size * 2, 3) + 10 * r + step
                               for r in range(size)])
    sent = np.repeat(np.arange(size, dtype=np.int64) + 100 * me + step, 2)
    received = np.repeat(np.array([100 * j + me + step for j in range(size)], dtype=np.int64), 2)
    return x, total, gathered, total[me * 2:(me + 1) * 2], sent, received


def _repeated_calls(hide_quick=False):
    import shmcomm
    from shmcomm.startup import session
    from shmcomm.algorithms import host
    from shmcomm.transport import shm as transport

    if hide_quick:  # this rank takes the full path in Python; the others the quick calls
        transport.quick_function = lambda which, bound: None  # as a build without them: none to bind at init
    shmcomm.init()
    size, me = shmcomm.size(), shmcomm.rank()
    wrapped, stepped = [], []
    full_wrap = host.wrap
    for step in range(4):
        if step == 0 and not hide_quick:  # no array may be wrapped, nor a step taken from Python
            host.wrap = lambda *args, **kwargs: wrapped.append(args[1]) or full_wrap(*args, **kwargs)
            comm = session.communicator()
            shm = getattr(comm, "host", comm).shm
            if shm.quick.allgather is not None:
                for name in ("allgather_begin", "allgather_finish", "alltoall_begin", "alltoall_finish",
                             "reducescatter"):
                    setattr(shm, name, lambda *args, _name=name: stepped.append(_name))
        x, total, gathered, share, sent, received = _expected(size, me, step)
        np.testing.assert_array_equal(shmcomm.allreduce(x, op=shmcomm.Sum), total)
        out = np.empty_like(x)
        assert shmcomm.allreduce(x, op=shmcomm.Sum, output=out) is out
        np.testing.assert_array_equal(out, total)
        inplace = x.copy()
        assert shmcomm.allreduce_(inplace, op=shmcomm.Average) is inplace
        np.testing.assert_allclose(inplace, total / size, rtol=1e-6)
        np.testing.assert_array_equal(shmcomm.allreduce(x, op=shmcomm.Max), gathered[(size - 1) * size * 2:])
        root = step % size
        want = np.arange(size * 6, dtype=np.float32).reshape(size * 2, 3) + 10 * root + step
        np.testing.assert_array_equal(shmcomm.broadcast(x, root), want)
        inplace = x.copy()
        assert shmcomm.broadcast_(inplace, root) is inplace
        np.testing.assert_array_equal(inplace, want)
        np.testing.assert_array_equal(shmcomm.allgather(x), gathered)
        out = np.empty_like(gathered)
        assert shmcomm.allgather(x, output=out) is out
        np.testing.assert_array_equal(out, gathered)
        np.testing.assert_array_equal(shmcomm.reducescatter(x, op=shmcomm.Sum), share)
        out = np.empty_like(share)
        assert shmcomm.reducescatter(x, op=shmcomm.Average, output=out) is out
        np.testing.assert_allclose(out, share / size, rtol=1e-6)
        np.testing.assert_array_equal(shmcomm.alltoall(sent), received)
        out = np.empty_like(received)
        got, counts = shmcomm.alltoall(sent, splits=[2] * size, output=out)
        assert got is out and list(counts) == [2] * size
        np.testing.assert_array_equal(out, received)
    host.wrap = full_wrap
    assert wrapped == [], "arrays wrapped on the short path: %s" % wrapped
    assert stepped == [], "steps taken from Python with the quick calls there: %s" % stepped
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_repeated_calls_take_the_short_path_and_give_the_same_results(size):
    assert multiproc.run(size, _repeated_calls, timeout=120, env=FAST_TIMEOUT) == [True] * size


def test_ranks_with_and_without_the_quick_calls_agree():
    """Rank 0 takes the full path in Python, the others the quick calls: the tags and counts they pass agree."""
    assert multiproc.run(3, _mixed_ranks, timeout=120, env=FAST_TIMEOUT) == [True] * 3


def _mixed_ranks():
    import os

    return _repeated_calls(hide_quick=os.environ["SHMCOMM_RANK"] == "0")


def _peers_change_their_rows():
    """A rank whose own array keeps its dtype and shape while the others send other row counts gets the right
    result every time, into a new array or into an output of the new shape."""
    import shmcomm

    shmcomm.init()
    size, me = shmcomm.size(), shmcomm.rank()
    for step in range(6):
        peers = 1 + step % 3  # rows each other rank contributes this step
        rows = [2 if r == 0 else peers for r in range(size)]
        x = np.full((rows[me], 3), 10 * me + step, np.float32)
        want = np.concatenate([np.full((rows[r], 3), 10 * r + step, np.float32) for r in range(size)])
        np.testing.assert_array_equal(shmcomm.allgather(x), want, err_msg="allgather, step %d" % step)
        out = np.empty_like(want)
        assert shmcomm.allgather(x, output=out) is out
        np.testing.assert_array_equal(out, want)
        # Alltoall: rank 0 sends each rank 1 row; every other rank sends rank 0 `peers` rows and the others 1.
        splits = [1] * size if me == 0 else [peers] + [1] * (size - 1)
        sent = np.concatenate([np.full((splits[j], 2), 100 * me + j + step, np.int64) for j in range(size)])
        from_each = [1] * size if me != 0 else [1] + [peers] * (size - 1)
        want = np.concatenate([np.full((from_each[j], 2), 100 * j + me + step, np.int64) for j in range(size)])
        got, counts = shmcomm.alltoall(sent, splits=splits)
        np.testing.assert_array_equal(got, want, err_msg="alltoall, step %d" % step)
        assert list(counts) == from_each
        out = np.empty_like(want)
        got, counts = shmcomm.alltoall(sent, splits=splits, output=out)
        assert got is out
        np.testing.assert_array_equal(out, want)
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_results_whose_shape_changes_with_the_peers(size):
    assert multiproc.run(size, _peers_change_their_rows, timeout=120, env=FAST_TIMEOUT) == [True] * size


def _unusual_arrays():
    """Rank 1 passes, after a call of the same dtype and shape, an array the quick calls must not take; it raises the
    full path's error and every other rank PeerArgumentError naming it (or, for a shape mismatch, every rank
    MismatchError naming every rank's shape); the next call works."""
    import shmcomm

    shmcomm.init()
    size, me = shmcomm.size(), shmcomm.rank()
    x = np.ones((4, 3), np.float32)
    seen = []

    def attempt(label, call, good):
        try:
            call(good)
            seen.append((label, "ok"))
        except shmcomm.PeerArgumentError as error:
            seen.append((label, "peer %d" % error.rank))
        except shmcomm.MismatchError as error:
            seen.append((label, "mismatch" + ("[4, 3]" in str(error) and "[3, 4]" in str(error)) * " named"))
        except shmcomm.InvalidArgumentError as error:
            seen.append((label, "own " + str(error).split(": ", 1)[1][:30]))
        try:
            got = shmcomm.allreduce(x, op=shmcomm.Sum)
        except (shmcomm.PeerArgumentError, shmcomm.MismatchError) as error:  # a broadcast's root heard of it here
            assert str(error).startswith("the broadcast before this allreduce (which no rank ran)"), str(error)
            seen.append((label + ", next", type(error).__name__))
            got = shmcomm.allreduce(x, op=shmcomm.Sum)
        np.testing.assert_array_equal(got, np.full((4, 3), size, np.float32))

    strided = np.ones((4, 6), np.float32)[:, ::2]
    read_only = np.ones((4, 3), np.float32)
    read_only.flags.writeable = False
    swapped = np.ones((4, 3), ">f4")
    cases = [
        ("non-contiguous", lambda good: shmcomm.allreduce(x if good else strided)),
        ("read-only in place", lambda good: shmcomm.allreduce_(x.copy() if good else read_only)),
        ("read-only output", lambda good: shmcomm.allreduce(x, output=np.empty_like(x) if good else read_only)),
        ("output dtype", lambda good: shmcomm.allreduce(x, output=np.empty((4, 3), np.float32 if good else np.int32))),
        ("byte order", lambda good: shmcomm.broadcast(x if good else swapped, 0)),
        ("broadcast output", lambda good: shmcomm.broadcast(x, 0, output=np.empty((4, 3) if good else (3, 4),
                                                                                     np.float32))),
        ("reducescatter output", lambda good: shmcomm.reducescatter(
            x, output=np.empty((4 // size + (me < 4 % size), 3) if good else (9, 3), np.float32))),
        ("shape", lambda good: shmcomm.allreduce(x if good else np.ones((3, 4), np.float32))),
    ]
    for label, call in cases:
        call(True)  # the dtype and shape are known from here on
        attempt(label, call, me != 1)
    # allgather and alltoall take their first step before the output's shape is known: a rank whose output does not
    # fit still takes part, then raises; the others get their results.
    for label, call in [("allgather output", lambda out: shmcomm.allgather(x, output=out)),
                        ("alltoall output", lambda out: shmcomm.alltoall(np.ones((size, 3), np.float32), output=out))]:
        rows = 4 * size if label.startswith("allgather") else size
        call(np.empty((rows, 3), np.float32))
        try:
            got = call(np.empty((rows, 3) if me != 1 else (rows + 1, 3), np.float32))
            seen.append((label, "ok %d" % len(got)))
        except shmcomm.InvalidArgumentError as error:
            seen.append((label, "own " + str(error).split(": ", 1)[1][:30]))
    return seen


def test_unusual_arrays_get_the_full_paths_errors_on_every_rank():
    results = multiproc.run(3, _unusual_arrays, timeout=120, env=FAST_TIMEOUT)
    for me, seen in enumerate(results):
        got = dict(seen)
        assert got["shape"] == "mismatch named", seen
        for label in ("non-contiguous", "read-only in place", "read-only output", "output dtype"):
            assert got[label].startswith("own " if me == 1 else "peer 1"), (label, seen)
        # A broadcast's root returns once it has published: the receiver that differs raises at once, the root and
        # the receiver that agreed with it at their next collective, which fails on every rank.
        assert got["byte order"] == ("mismatch" if me == 1 else "ok"), seen  # another dtype, as on the full path
        assert got["broadcast output"].startswith("own " if me == 1 else "ok"), seen
        assert got["byte order, next"] == "MismatchError" and got["broadcast output, next"] == "PeerArgumentError"
        # Reducescatter, allgather and alltoall take part into a new array when the output does not fit (their
        # steps may have begun), then raise on that rank only.
        mine = got["reducescatter output"]
        assert mine == "ok" if me != 1 else mine.startswith("own output is"), seen
        for label in ("allgather output", "alltoall output"):
            assert got[label] == ("ok %d" % (12 if label.startswith("allgather") else 3)) if me != 1 else \
                got[label].startswith("own output is float32"), (label, seen)
