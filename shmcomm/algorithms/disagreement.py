# SPDX-License-Identifier: Apache-2.0
"""After ranks across hosts disagree on a collective, every rank says the same thing: who passed what.

Each rank packs what it passed (its description.Collective) into a row of integers, the rows are allgathered (over
the MPI transport, within its deadline, or over the host's shared memory for a grid on one host), and the message
groups ranks that passed the same."""
import numpy as np

from shmcomm.vocabulary import description
from shmcomm.transport import memory
from shmcomm.vocabulary.exceptions import MismatchError, ShmCommError


def disagreement_error(what, collective, mpi, shm, names=None, ranks=None):
    """The MismatchError every rank raises, naming what each rank passed (`names`: dtype keys of types the core does
    not reduce, in words; `ranks`: the communicator's job ranks, where they are not its indices)."""
    every = gather_rows(collective.words(), mpi, shm)
    if every is None:
        return MismatchError("%s: ranks disagree on the tensor or the collective (their descriptions could not be "
                             "collected)" % what)
    text = description.disagreement({(r if ranks is None else ranks[r]): description.Collective.from_words(row)
                                     for r, row in enumerate(every)}, names)
    if text.startswith("all passed"):
        return MismatchError("%s: ranks disagree on the arguments, though %s" % (what, text))
    return MismatchError("%s: ranks disagree: %s" % (what, text))


def gather_rows(mine, mpi, shm):
    """Every rank's row (int64), or None if that fails."""
    if mpi is not None:
        return mpi.allgather_rows(mine)
    every = np.zeros((shm.size, mine.size), dtype=np.int64)
    try:
        shm.allgatherv(memory.address(mine), mine.nbytes, memory.address(every), [mine.nbytes] * shm.size, 0,
                       "disagreement")
    except ShmCommError:
        return None
    return every
