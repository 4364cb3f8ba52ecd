# SPDX-License-Identifier: Apache-2.0
"""Gradient compression for allreduce, as Horovod's `Compression`: compress(tensor) -> (tensor, ctx) before the
collective, decompress(tensor, ctx) after it."""
import torch


class Compressor:
    """The interface; both methods are static so that the classes themselves are the compressors."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); other dtypes pass through. The reduction itself
    accumulates in float32 and rounds once, so only the inputs and the result are rounded to float16."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.type(ctx)
        return tensor


class Compression:
    """The available compressors: Compression.none and Compression.fp16."""

    none = NoneCompressor
    fp16 = FP16Compressor
