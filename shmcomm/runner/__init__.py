# SPDX-License-Identifier: Apache-2.0
"""shmcommrun: starts the ranks of a job (on this host, or across hosts through the MPI wheel's mpiexec) and
supervises them.

Standard library only and no import of the native core, so the launcher starts fast and works before (or
without) a build of the C core.
"""

from .cli import main

__all__ = ["main"]
