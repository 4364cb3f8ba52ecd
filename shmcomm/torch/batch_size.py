# SPDX-License-Identifier: Apache-2.0
"""Batch-size control (Mikami et al., Sony, arXiv:1811.05233): the global batch grows during training, at chosen
epochs, without restarting the job.

Each rank keeps its per-pass batch; the optimizer accumulates more backward passes per step instead
(DistributedOptimizer's backward_passes_per_step), so the global batch is size() * per-pass batch * passes. The
learning rate follows the linear scaling rule (Goyal et al.): it is multiplied by new passes / old passes whenever
the passes change, on top of whatever else sets it."""


class BatchSizeSchedule:
    """Grows the global batch at chosen epochs: more backward passes per step, and the learning rate scaled to match.

    With average_aggregated_gradients=True the step's gradient is the mean over the whole global batch, which is what a
    single process computing that batch at once would get; without it (Horovod's default for PyTorch) it is the sum over
    the passes, and the learning rate then needs no scaling (scale_lr=False).

    Args:
        optimizer: a DistributedOptimizer.
        schedule: {epoch: backward passes per step}; the entry for the latest epoch reached applies, and epoch 0 must be
            there.
        scale_lr: multiply every parameter group's learning rate by the ratio of passes at each change.

    Raises:
        ValueError: not a DistributedOptimizer, or a schedule without epoch 0 or with passes that are not positive
            integers.

    Example:
            optimizer = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                 average_aggregated_gradients=True)
            schedule = hvd.BatchSizeSchedule(optimizer, {0: 1, 30: 2, 60: 4})   # epoch -> passes per step
            for epoch in range(90):
                schedule.set_epoch(epoch)
                for i, (x, y) in enumerate(loader):
                    loss_fn(model(x), y).backward()
                    if schedule.step_due(i):
                        optimizer.step()
                        optimizer.zero_grad()
    """

    def __init__(self, optimizer, schedule, scale_lr=True):
        if not hasattr(optimizer, "set_backward_passes_per_step"):
            raise ValueError("BatchSizeSchedule needs a DistributedOptimizer")
        if 0 not in schedule or any(int(p) != p or p < 1 for p in schedule.values()):
            raise ValueError("schedule must map epoch 0 (and later epochs) to positive integer passes, got %r"
                             % (schedule,))
        self.optimizer = optimizer
        self.schedule = dict(sorted((int(e), int(p)) for e, p in schedule.items()))
        self.scale_lr = scale_lr
        self.passes = optimizer.backward_passes_per_step

    def passes_at(self, epoch):
        """The backward passes per step the schedule gives for an epoch.

        Args:
            epoch: an epoch number, from 0.

        Returns:
            An int.
        """
        return [p for e, p in self.schedule.items() if e <= epoch][-1]

    def set_epoch(self, epoch):
        """Applies the schedule for an epoch; call it before the epoch's first backward pass, on every rank.

        Args:
            epoch: the epoch about to start.

        Returns:
            The backward passes per step from now on.
        """
        passes = self.passes_at(epoch)
        if passes != self.passes:
            if self.scale_lr:
                for group in self.optimizer.param_groups:
                    group["lr"] *= passes / self.passes
            self.optimizer.set_backward_passes_per_step(passes)
            self.passes = passes
        return passes

    def step_due(self, batch_index):
        """Whether a backward pass is the last of its step.

        Args:
            batch_index: the pass's batch number, counted from 0 within the epoch.

        Returns:
            True when optimizer.step() is due after this pass.
        """
        return (batch_index + 1) % self.passes == 0
