# SPDX-License-Identifier: Apache-2.0
"""Batch normalization over the whole batch of every rank (Horovod's SyncBatchNorm), on CPU tensors.

In training, every rank allgathers its per-channel (mean, biased variance, count) and combines them exactly, so
ranks may hold different numbers of samples (even none). Backward allreduces the per-channel sums of the gradient
and of gradient times the normalized input, which is what the input gradient over the whole batch needs; the weight
and bias gradients stay local, as in torch.nn.SyncBatchNorm (the gradient averaging of the optimizer or DDP
combines them). In eval mode the running statistics are used and nothing is exchanged."""
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from shmcomm.process_sets import global_process_set
from shmcomm.torch import mpi_ops
from shmcomm.torch.mpi_ops import Sum

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the whole batch of every rank of a process set (Horovod's SyncBatchNorm): a drop-in for
    torch.nn.BatchNorm1d/2d/3d on CPU tensors.

    Args:
        num_features: the number of channels (the input's second dimension).
        eps, momentum, affine, track_running_stats: as torch.nn.BatchNorm2d.
        process_set: the ranks whose batches are normalized together (default: every rank).

    Example:
        `model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8))`.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got {}D input)".format(input.dim()))

    def forward(self, input):
        """Normalizes `input` with the mean and variance of the whole batch over the ranks of the process set while
        training; as BatchNorm otherwise (eval mode exchanges nothing).

        Args:
            input: a tensor of at least 2 dimensions (batch, channels, ...).

        Returns:
            The normalized tensor, of the input's shape.

        Raises:
            ValueError: an input of fewer than 2 dimensions.
        """
        self._check_input_dim(input)
        sync = self.training and self.process_set.included() and self.process_set.size() > 1
        if not sync:
            return super().forward(input)  # eval mode (running statistics), or a world of one
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                            factor, self.process_set)


def _shape(x):
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        x = x.contiguous()
        xf = x.float() if x.dtype in _LOW_PRECISION else x
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        count = x.numel() // channels if channels else 0
        if count:
            var, mean = torch.var_mean(xf, dim=dims, unbiased=False)
        else:
            var = mean = torch.zeros(channels, dtype=xf.dtype)
        # float64 for the exchange: counts stay exact and the combination loses nothing.
        mine = torch.cat([mean.double(), var.double(), torch.tensor([float(count)], dtype=torch.float64)])
        every = mpi_ops.allgather(mine.unsqueeze(0), process_set=process_set)
        counts = every[:, -1:]
        total = float(counts.sum())
        if total == 0:
            raise ValueError("SyncBatchNorm: no rank has any sample in this batch")
        means, variances = every[:, :channels], every[:, channels:2 * channels]
        mean_all = (counts * means).sum(0) / total
        # Chan's combination: each rank's variance plus the spread of its mean around the global one.
        var_all = (counts * (variances + (means - mean_all) ** 2)).sum(0) / total
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean_all.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var_all * (total / (total - 1)) if total > 1 else var_all
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = _shape(x)
        invstd = torch.rsqrt(var_all + eps).to(xf.dtype)
        xhat = (xf - mean_all.to(xf.dtype).view(shape)) * invstd.view(shape)
        y = xhat if weight is None else xhat * weight.to(xf.dtype).view(shape)
        if bias is not None:
            y = y + bias.to(xf.dtype).view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.process_set, ctx.has_bias = total, process_set, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        xhat, weight, invstd = ctx.saved_tensors
        g = grad_output.contiguous().to(xhat.dtype)
        channels = xhat.shape[1]
        dims = [0] + list(range(2, xhat.dim()))
        sum_g = g.sum(dims)
        sum_gx = (g * xhat).sum(dims)
        # Every rank takes part in the exchange, whatever it needs, so that the ranks stay in step.
        both = mpi_ops.allreduce(torch.cat([sum_g, sum_gx]).double(), op=Sum, process_set=ctx.process_set)
        shape = _shape(xhat)
        mean_g = (both[:channels] / ctx.total).to(xhat.dtype).view(shape)
        mean_gx = (both[channels:] / ctx.total).to(xhat.dtype).view(shape)
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        grad_input = (g - mean_g - xhat * mean_gx) * scale.view(shape)
        grad_weight = sum_gx.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_g.to(weight.dtype if weight is not None else g.dtype) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input.to(grad_output.dtype), grad_weight, grad_bias, None, None, None, None, None
