# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors as NCCL takes them: the dtypes and ops it reduces, 16-bit integers widened, fusion pieces aligned."""
from shmcomm.vocabulary import ops
from shmcomm.vocabulary.exceptions import NotSupportedError

NCCL_OPS = {ops.Sum: "sum", ops.Average: "sum", ops.Min: "min", ops.Max: "max", ops.Product: "product"}


def nccl_dtype(tensor, what):
    """NCCL's name of `tensor`'s dtype; NotSupportedError for one it does not reduce (see widened())."""
    name = str(tensor.dtype).replace("torch.", "")
    if name not in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"):
        raise NotSupportedError("%s: NCCL does not reduce %s tensors" % (what, name))
    return name


def widened(torch, t):
    """`t` as NCCL can reduce it: NCCL has no 16-bit integers, so int16 goes as int32 (narrowed back afterwards, which
    wraps as the host path's int16 arithmetic does); any other tensor as it is."""
    return t.to(torch.int32) if t.dtype == torch.int16 else t


def aligned_offsets(counts, element_size, alignment=16):
    """Where pieces of `counts` elements start in a fusion buffer so that each starts on an `alignment`-byte boundary
    (the batched copy kernel then moves 16 bytes at a time), and the buffer's length; both in elements."""
    step = max(1, alignment // element_size)
    offsets, at = [], 0
    for n in counts:
        offsets.append(at)
        at += -(-n // step) * step
    return offsets, at
