# SPDX-License-Identifier: Apache-2.0
"""Exact expectations for every collective, computed with numpy alone, for tests that run ranks in any way (forked
by tests/multiproc.py, started by mpiexec, or by shmcommrun across simulated hosts).

Every rank can build every rank's input (they are functions of the rank), so each rank checks each result against
an expectation computed here, never with the library under test (run_checks). Results that must be identical on
every rank are hashed (sha256 of their full bytes) into `digests`, and the test process compares the ranks' digests
(assert_identical), so that no collective of the library judges its own results.
"""
import json
import os

import numpy as np

from shmcomm.testing.expected import (FLOATS, ROUNDING_COUNT, allreduce_input, digest, expected_allreduce, random_for,
                                      from_library, rounded_once, rounding_input, rounding_is_visible, to_library)

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64")
OPS = ("Sum", "Average", "Min", "Max", "Product")
SMALL_COUNTS = (0, 1, 7, 1001)
LARGE_BYTES = 300_000  # past the torus's small-message size (256 KiB) for every dtype
MID_BYTES = 100_000    # on the torus's small path, where 4 or more hosts halve (agreement.HALVING_BYTES, 64 KiB)


class Report:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size
        self.digests = {}
        self.rounding = {}
        self.checked = 0

    def same_everywhere(self, name, result):
        if name in self.digests:
            raise AssertionError("two results named %r" % name)
        self.digests[name] = digest(result)

    def as_dict(self):
        return {"rank": self.rank, "size": self.size, "digests": self.digests, "rounding": self.rounding,
                "checked": self.checked}


def _equal(report, got, want, what):
    values, _ = from_library(got)
    want = np.asarray(want)
    if values.shape != want.shape or not np.array_equal(values.astype(np.float64), want.astype(np.float64)):
        bad = "" if values.shape != want.shape else " first differences at %s" % (
            np.argwhere(values.astype(np.float64) != want.astype(np.float64))[:5].tolist())
        raise AssertionError("rank %d: %s: got %s %s, expected %s %s%s" % (
            report.rank, what, values.shape, values.reshape(-1)[:8].tolist(), want.shape,
            want.reshape(-1)[:8].tolist(), bad))
    report.checked += 1


def _large_count(dtype, nbytes=LARGE_BYTES):
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    return nbytes // itemsize + 7  # divides by neither 2 nor 3 (nor 4) for these item sizes


def _allreduce_case(shmcomm, report, count, dtype, op, prescale=1.0, postscale=1.0):
    me, n = report.rank, report.size
    scaled = (prescale, postscale) != (1.0, 1.0)
    inputs = [allreduce_input(r, n, count, dtype, op, scaled) for r in range(n)]
    want = expected_allreduce(inputs, dtype, op, prescale, postscale)
    x = to_library(inputs[me], dtype)
    what = "allreduce %s %s count %d scale (%g, %g)" % (dtype, op, count, prescale, postscale)
    got = shmcomm.allreduce(x, op=getattr(shmcomm, op), prescale_factor=prescale, postscale_factor=postscale)
    _equal(report, got, want, what)
    report.same_everywhere(what, got)
    if count == 7:  # in place too
        inplace = to_library(inputs[me], dtype)
        returned = shmcomm.allreduce_(inplace, op=getattr(shmcomm, op), prescale_factor=prescale,
                                      postscale_factor=postscale)
        assert returned is inplace, what
        _equal(report, inplace, want, what + " in place")


def check_allreduce(shmcomm, report, dtypes, large=True):
    for dtype in dtypes:
        for count in SMALL_COUNTS:
            for op in OPS:
                _allreduce_case(shmcomm, report, count, dtype, op)
        if dtype in FLOATS:  # factors that do not cancel: ignoring either one gives another result
            for count in (7, 1001):
                _allreduce_case(shmcomm, report, count, dtype, "Sum", 3.0, 0.5)
                _allreduce_case(shmcomm, report, count, dtype, "Average", 3.0, 0.5)
        elif dtype in ("int16", "int32", "int64"):
            _allreduce_case(shmcomm, report, 7, dtype, "Sum", 2.0, 3.0)
        if large:
            _allreduce_case(shmcomm, report, _large_count(dtype), dtype, "Sum")
            _allreduce_case(shmcomm, report, _large_count(dtype, MID_BYTES), dtype, "Sum")
    if large:
        _allreduce_case(shmcomm, report, _large_count("float32", MID_BYTES), "float32", "Average", 3.0, 0.5)
        _allreduce_case(shmcomm, report, _large_count("int64", MID_BYTES), "int64", "Max")
        _allreduce_case(shmcomm, report, _large_count("float32"), "float32", "Sum", 3.0, 0.5)
        _allreduce_case(shmcomm, report, _large_count("float32"), "float32", "Average")
        _allreduce_case(shmcomm, report, _large_count("int32"), "int32", "Average")


def check_noisy_sums(shmcomm, report, large=True):
    """Float sums whose bits depend on the order of the additions: every rank must still get the same bits."""
    me, n = report.rank, report.size
    for dtype in ("float32", "float64"):
        for count in (1001,) + ((_large_count(dtype, MID_BYTES), _large_count(dtype)) if large else ()):
            inputs = [random_for("noisy", r, dtype, count).standard_normal(count).astype(dtype) for r in range(n)]
            got = shmcomm.allreduce(inputs[me], op=shmcomm.Sum)
            want = np.sum(np.stack(inputs).astype(np.float64), axis=0)
            if not np.allclose(got, want, rtol=0, atol=1e-4 * n):
                raise AssertionError("rank %d: noisy %s sum of %d is off by %g" % (me, dtype, count,
                                                                                   np.abs(got - want).max()))
            report.same_everywhere("noisy %s sum count %d" % (dtype, count), got)
            report.checked += 1


def check_rounding(shmcomm, report, dtypes, large=True):
    """Records, per 16-bit dtype and count, how many elements differ from the float32 sum rounded once."""
    n = report.size
    for dtype in dtypes:
        for count in (ROUNDING_COUNT,) + ((_large_count(dtype),) if large else ()):
            inputs = [rounding_input(r, dtype, count) for r in range(n)]
            once = rounded_once(inputs, dtype)
            got = shmcomm.allreduce(to_library(inputs[report.rank], dtype), op=shmcomm.Sum)
            values, _ = from_library(got)
            key = "%s count %d" % (dtype, count)
            report.rounding[key] = int(np.sum(values.astype(np.float32).view(np.uint32) != once.view(np.uint32)))
            report.same_everywhere("rounding " + key, got)


def _rows_of(rank, rows, width, dtype, tag):
    """rows x width array whose row i is [tag, rank, i, ...]: any row says where it came from."""
    block = np.zeros((rows, width), dtype=np.float64)
    block[:, 0] = tag
    block[:, 1] = rank
    if width > 2:
        block[:, 2] = np.arange(rows) % (100 if dtype in ("int8", "uint8") else 30_000)
    if width > 3:
        block[:, 3:] = (np.arange(rows)[:, None] // 100 + np.arange(width - 3)[None, :]) % 100
    return block


def check_allgather(shmcomm, report, dtypes, large=True):
    me, n = report.rank, report.size
    for dtype in dtypes:
        rows = [r % 3 for r in range(n)]  # rank 0 (and every third) sends nothing
        blocks = [_rows_of(r, rows[r], 4, dtype, 7) for r in range(n)]
        got = shmcomm.allgather(to_library(blocks[me], dtype))
        _equal(report, got, np.concatenate(blocks), "allgather %s rows %s" % (dtype, rows))
        report.same_everywhere("allgather %s" % dtype, got)
    flags = shmcomm.allgather(np.array([me % 2 == 0, True, me == n - 1]))  # bool moves, though it does not reduce
    _equal(report, flags, np.array([[r % 2 == 0, True, r == n - 1] for r in range(n)]).reshape(-1), "allgather bool")
    if large:
        rows = [40_000 * (r % 2 + 1) + r for r in range(n)]
        blocks = [_rows_of(r, rows[r], 3, "int32", 9) for r in range(n)]
        got = shmcomm.allgather(blocks[me].astype(np.int32))
        _equal(report, got, np.concatenate(blocks), "allgather int32 large")
        report.same_everywhere("allgather int32 large", got)


def check_broadcast(shmcomm, report, large=True):
    me, n = report.rank, report.size
    counts = (0, 13) + ((100_003,) if large else ())
    for root in range(n):
        for count in counts:
            for dtype in ("float64", "int16"):
                values = [(np.arange(count) * (r + 1) + 100 * r) % 30_000 for r in range(n)]
                x = values[me].astype(dtype)
                got = shmcomm.broadcast(x, root_rank=root)
                what = "broadcast %s count %d from %d" % (dtype, count, root)
                _equal(report, got, values[root], what)
                _equal(report, x, values[me], what + " leaves the input")
                report.same_everywhere(what, got)
        y = np.full(3, me, dtype=np.int32)
        assert shmcomm.broadcast_(y, root) is y
        _equal(report, y, np.full(3, root), "broadcast_ from %d" % root)


def _shares(rows, n):
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def _reducescatter_case(shmcomm, report, rows, dtype, op, prescale=1.0, postscale=1.0, width=3):
    me, n = report.rank, report.size
    count = rows * width
    scaled = (prescale, postscale) != (1.0, 1.0)
    inputs = [allreduce_input(r, n, count, dtype, op, scaled) for r in range(n)]
    # Rank 0's row i also carries i in its first column (times n, so that an average stays exact; modulo a little
    # where larger numbers would not be exact): a rank handed other rows fails on them even where the data agree.
    inputs[0][::width] += n * (np.arange(rows) % (1000 if dtype in ("float32", "float64", "int32") else 5))
    want = expected_allreduce(inputs, dtype, op, prescale, postscale).reshape(rows, width)
    shares = _shares(rows, n)
    start = sum(shares[:me])
    got = shmcomm.reducescatter(to_library(inputs[me].reshape(rows, width), dtype), op=getattr(shmcomm, op),
                                prescale_factor=prescale, postscale_factor=postscale)
    _equal(report, got, want[start:start + shares[me]], "reducescatter %s %s rows %d (shares %s) scale (%g, %g)"
           % (dtype, op, rows, shares, prescale, postscale))


def check_reducescatter(shmcomm, report, dtypes, large=True):
    n = report.size
    for dtype in dtypes:
        # Fewer rows than ranks: the last ranks get none. Not for torch tensors (bfloat16), whose empty shares the
        # library refuses (tests/test_collectives.py: test_reducescatter_of_torch_tensors_leaves_some_ranks_none).
        for rows in sorted({2 * n + 1} if dtype == "bfloat16" else {1, max(n - 1, 1), 2 * n + 1}):
            for op in ("Sum", "Average", "Max"):
                _reducescatter_case(shmcomm, report, rows, dtype, op)
        if dtype in FLOATS:
            _reducescatter_case(shmcomm, report, 2 * n + 1, dtype, "Sum", 3.0, 0.5)
    if large:
        _reducescatter_case(shmcomm, report, 20_003, "float32", "Sum", width=4)


def check_alltoall(shmcomm, report, dtypes, large=True):
    me, n = report.rank, report.size
    for dtype in dtypes:
        # Rank s sends (s + j) % 3 rows to rank j; each row says who sent it to whom, and its index.
        def sent(s, j):
            return _rows_of(s, (s + j) % 3, 3, dtype, j)
        mine = np.concatenate([sent(me, j) for j in range(n)])
        out, received = shmcomm.alltoall(to_library(mine, dtype), splits=[(me + j) % 3 for j in range(n)])
        what = "alltoall %s" % dtype
        _equal(report, received, [(s + me) % 3 for s in range(n)], what + " received splits")
        _equal(report, out, np.concatenate([sent(s, me) for s in range(n)]), what)
    even = np.concatenate([_rows_of(me, 2, 3, "int64", j) for j in range(n)])
    _equal(report, shmcomm.alltoall(even.astype(np.int64)),
           np.concatenate([_rows_of(s, 2, 3, "int64", me) for s in range(n)]), "alltoall without splits")
    if large:
        big = np.concatenate([_rows_of(me, 30_000 + j, 3, "float64", j) for j in range(n)])
        out, received = shmcomm.alltoall(big, splits=[30_000 + j for j in range(n)])
        _equal(report, received, [30_000 + me] * n, "alltoall large received splits")
        _equal(report, out, np.concatenate([_rows_of(s, 30_000 + me, 3, "float64", me) for s in range(n)]),
               "alltoall large")


def run_checks(out_dir=None, bf16=None, large=True):
    """Every check above on this rank (shmcomm.init() first); returns the report as a dict and, with `out_dir`,
    writes it to out_dir/checks.<rank>.json. bf16=None: bfloat16 too when torch can be imported. The checks:

    - allreduce: every dtype and op, pre- and postscale factors that do not cancel, integer Average (truncating),
      counts that do not divide by the row size, and a count past the torus's small-message size;
    - allgather, reducescatter, alltoall: the full contents, with uneven first dimensions and splits (some ranks send
      or get nothing), so that a rank that gets another rank's rows fails;
    - broadcast from every root;
    - 16-bit floats: the library accumulates in float32 and rounds once. `rounding` compares the library's sums of
      inputs chosen so that rounding at each step would give other bits (checked here too) with the float32 sum
      rounded once.

        report = run_checks()              # on every rank; also written to out_dir/checks.<rank>.json if given
        assert_identical(reports)          # in the test process
    """
    import shmcomm

    shmcomm.init()
    report = Report(shmcomm.rank(), shmcomm.size())
    if bf16 is None:
        try:
            import torch  # noqa: F401
            bf16 = True
        except ImportError:
            bf16 = False
    dtypes = [d for d in DTYPES if bf16 or d != "bfloat16"]
    check_allreduce(shmcomm, report, dtypes, large)
    check_noisy_sums(shmcomm, report, large)
    check_rounding(shmcomm, report, [d for d in ("float16", "bfloat16") if d in dtypes], large)
    check_allgather(shmcomm, report, dtypes, large)
    check_broadcast(shmcomm, report, large)
    check_reducescatter(shmcomm, report, [d for d in ("float16", "float32", "float64", "int8", "int32")
                                          if d in dtypes] + (["bfloat16"] if bf16 else []), large)
    check_alltoall(shmcomm, report, ("int16", "float32", "uint8"), large)
    shmcomm.barrier()
    result = report.as_dict()
    if out_dir is not None:
        path = os.path.join(out_dir, "checks.%d.json" % report.rank)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)
    return result


# ---- the test process's side ----

def read_reports(out_dir, size):
    reports = []
    for rank in range(size):
        path = os.path.join(out_dir, "checks.%d.json" % rank)
        if not os.path.exists(path):
            raise AssertionError("rank %d wrote no report (%s)" % (rank, path))
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def assert_identical(reports):
    """Every rank ran the same checks and got the same bytes for every result that must be identical."""
    assert [r["rank"] for r in reports] == list(range(len(reports))), [r["rank"] for r in reports]
    first = reports[0]["digests"]
    assert first, "no results were recorded"
    for report in reports[1:]:
        assert sorted(report["digests"]) == sorted(first), "ranks ran different checks"
        differ = [name for name in first if report["digests"][name] != first[name]]
        assert not differ, "rank %d's results differ from rank 0's: %s" % (report["rank"], differ[:10])


def rounding_errors(reports):
    """{check: elements that differ from the float32 sum rounded once}, over every rank."""
    errors = {}
    for report in reports:
        for name, count in report["rounding"].items():
            errors[name] = max(errors.get(name, 0), count)
    return errors


def assert_rounds_once(reports):
    errors = rounding_errors(reports)
    assert errors, "no 16-bit float sums were checked"
    assert not any(errors.values()), "16-bit float sums differ from the float32 sum rounded once: %s" % errors


def assert_rounding_is_visible(size):
    """The inputs of check_rounding for `size` ranks tell rounding once from rounding at every step."""
    assert size >= 3, "with fewer than 3 ranks a sum has one addition: nothing to tell apart"
    for dtype in ("float16", "bfloat16"):
        inputs = [rounding_input(r, dtype) for r in range(size)]
        assert rounding_is_visible(inputs, dtype), (dtype, size)
