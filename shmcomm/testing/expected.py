# SPDX-License-Identifier: Apache-2.0
"""The numbers the exact checks (exact.py) expect, computed with numpy alone: each rank's inputs (functions of the
rank, so that every rank can build every rank's), the reductions of them, 16-bit rounding done once or at every step,
and digests of results."""
import hashlib

import numpy as np

FLOATS = ("float16", "bfloat16", "float32", "float64")
ROUNDING_COUNT = 4096


# ---- 16-bit floats without ml_dtypes: bfloat16 values travel as torch tensors, are computed here as float32 ----

def round_to(values, dtype):
    """float32 `values` rounded once (to nearest, ties to even) to `dtype`, returned as float32 (float64 values stay
    float64)."""
    if dtype == "float64":
        return np.asarray(values, dtype=np.float64)
    values = np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return rounded.astype(np.uint32).view(np.float32)
    return values.astype(dtype).astype(np.float32)


def to_library(values, dtype):
    """What the library is given for `values` (exactly representable in `dtype`)."""
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
    return np.ascontiguousarray(values).astype(dtype)


def from_library(result):
    """A result as a numpy array (bfloat16 as float32) and its raw bytes."""
    if hasattr(result, "numpy"):  # a torch tensor
        import torch

        if result.dtype == torch.bfloat16:
            return result.float().numpy(), result.view(torch.int16).numpy().tobytes()
        result = result.numpy()
    return result, result.tobytes()


def digest(result):
    return hashlib.sha256(from_library(result)[1]).hexdigest()


# ---- inputs: functions of (rank, what), so that every rank knows every rank's ----

def random_for(*words):
    """A generator seeded by `words` (rank, collective, dtype...): the same numbers in every process."""
    seed = int.from_bytes(hashlib.sha256(str(words).encode()).digest()[:4], "little")
    return np.random.default_rng([seed])


def allreduce_input(rank, n, count, dtype, op, scaled=False):
    """Small integers (float64), so that every sum, product and average is exact in every dtype."""
    rng = random_for("allreduce", rank, count, dtype, op, scaled)
    unsigned = dtype == "uint8"
    if op == "Product":
        values = rng.choice([1, 2] if unsigned else [-2, -1, 1, 2], size=count)  # |product| <= 2**8: exact
    elif op == "Average" and dtype in FLOATS:
        # base + n*k on rank r: the sum is a multiple of n, so the average is an integer whatever the rounding of
        # the factor 1/n.
        base = random_for("base", count, dtype, scaled).integers(0 if unsigned else -3, 4, size=count)
        values = base + n * rng.integers(-1, 2, size=count)
    elif op == "Average":
        values = rng.integers(0 if unsigned else -7, 8, size=count)  # sums that do not divide: truncation
    else:
        values = rng.integers(0 if unsigned else -3, 4, size=count)
    return values.astype(np.float64)


def expected_allreduce(inputs, dtype, op, prescale=1.0, postscale=1.0):
    """The result for these inputs (exact in every dtype before the last step). Floats: one multiply by
    postscale / divisor, that factor rounded to the type the sum is computed in (float32 for 16-bit floats), then one
    rounding to the dtype, as docs/numpy.md's "16-bit floats accumulate in float32 and round once" has it."""
    stack = np.stack(inputs).astype(np.float64) * prescale
    n = len(inputs)
    if op in ("Sum", "Average"):
        total = stack.sum(0)
    elif op == "Min":
        total = stack.min(0)
    elif op == "Max":
        total = stack.max(0)
    else:
        total = stack.prod(0)
    if dtype in FLOATS:
        divisor = n if op == "Average" else 1
        if (postscale, divisor) == (1.0, 1):
            return total
        compute = np.float64 if dtype == "float64" else np.float32
        return round_to(total.astype(compute) * compute(postscale / divisor), dtype).astype(np.float64)
    exact = (total * postscale).astype(np.int64)
    if op == "Average":
        exact = np.sign(exact) * (np.abs(exact) // n)  # toward zero, as Horovod
    return exact.astype(dtype).astype(np.float64)  # integer sums and products wrap like the C types


def rounding_input(rank, dtype, count=ROUNDING_COUNT):
    """16-bit floats of mixed signs and magnitudes in [1/8, 8): their float32 sum over up to 256 ranks is exact."""
    rng = random_for("rounding", rank, dtype)
    magnitude = np.exp2(rng.uniform(-3, 3, size=count))
    return round_to(magnitude * rng.choice([-1.0, 1.0], size=count), dtype)


def rounded_once(inputs, dtype):
    return round_to(np.sum(np.stack(inputs), axis=0, dtype=np.float32), dtype)


def rounded_every_step(inputs, dtype, order):
    """The sum rounded to `dtype` after every addition, in the nested `order` of rank indices."""
    if isinstance(order, int):
        return inputs[order]
    total = rounded_every_step(inputs, dtype, order[0])
    for part in order[1:]:
        total = round_to(total + rounded_every_step(inputs, dtype, part), dtype)
    return total


def step_orders(n):
    """Orders in which a stepwise sum could go: rank order, reversed, and pairs first (a row, then a column)."""
    pairs = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
    return [list(range(n)), list(reversed(range(n))), pairs]


def rounding_is_visible(inputs, dtype):
    """True when summing these inputs with a rounding after every step, in every order of step_orders, gives other
    bits than rounding once: a library that rounded at every step would fail the check."""
    once = rounded_once(inputs, dtype)
    return all(not np.array_equal(rounded_every_step(inputs, dtype, order), once) for order in step_orders(len(inputs)))


# ---- the checks ----
