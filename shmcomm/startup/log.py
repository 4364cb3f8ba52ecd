# SPDX-License-Identifier: Apache-2.0
"""The library's logging: the standard `logging` module, under the "shmcomm" logger and its children
("shmcomm.algorithms": the algorithm each allreduce takes; "shmcomm.engine": what each cycle runs).

SHMCOMM_LOG_LEVEL (or HOROVOD_LOG_LEVEL, as `shmcommrun --log-level` sets) takes Horovod's names: trace, debug,
info, warning, error, fatal. When it is set, records go to stderr with the rank, unless the application gave the
"shmcomm" logger a handler of its own; when it is not, the logger is left to the application (warnings and errors
reach Python's last-resort handler)."""
import logging

logger = logging.getLogger("shmcomm")


class _RankFilter(logging.Filter):
    """Puts this process's job rank into each record ("?" until init() has learnt it)."""

    rank = "?"

    def filter(self, record):
        record.rank = self.rank
        return True


_rank_filter = _RankFilter()


def joined(world):
    """Records where this process sits, once init() has built the world communicator."""
    topo = world.topology
    _RankFilter.rank = str(topo.rank)
    logger.info("rank %d of %d, local rank %d of %d, host %d of %d, over %s", topo.rank, topo.size, topo.local_rank,
                topo.local_size, topo.cross_rank, topo.cross_size, type(world).__name__)


def configure(level, with_time=False):
    """Applies env.log_level(), a logging level (None: leave logging alone); with_time (HOROVOD_LOG_HIDE_TIME=0,
    `shmcommrun --log-with-timestamp`) starts each record with the time."""
    if level is None:
        return
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.addFilter(_rank_filter)
        text = "[%(rank)s] shmcomm %(levelname)s %(name)s: %(message)s"
        handler.setFormatter(logging.Formatter("%(asctime)s " + text if with_time else text))
        logger.addHandler(handler)
        logger.propagate = False  # once on stderr is enough, whatever the application's root logger does
