# SPDX-License-Identifier: Apache-2.0
"""The MPICH node segments of a job, as its own ranks name them.

MPICH names a node's segment after the job's world (`mpich_shm_<world>_<node>`, `mpich_vci_<world>_<node>`), a
value hydra draws at random. A test that checks a failed job left nothing of MPICH's in /dev/shm asks the job's
ranks for its world instead of listing what appeared in /dev/shm meanwhile, which other jobs on the machine change:

    worlds = mpi_segments.worlds()            # in a rank, once MPI has started
    assert not mpi_segments.left(worlds)      # in the test, once the job has ended
"""
import os

from shmcomm.runner.cleanup import MPICH_PREFIXES, SHM_DIR


def worlds(maps_path="/proc/self/maps"):
    """The MPICH worlds (hex strings) of the node segments this process maps, sorted; none before MPI starts, or
    when MPICH kept to one process per node and so made no segment."""
    found = set()
    with open(maps_path) as maps:
        for line in maps:
            name = os.path.basename(line.rstrip("\n").removesuffix(" (deleted)"))
            if name.startswith(MPICH_PREFIXES):
                found.add(name.split("_")[2])  # mpich_<kind>_<world>_<node>
    return sorted(found)


def left(worlds, shm_dir=SHM_DIR):
    """The files of these MPICH worlds still in shm_dir, sorted."""
    if not worlds:
        return []
    prefixes = tuple(prefix + world + "_" for world in worlds for prefix in MPICH_PREFIXES)
    return sorted(n for n in os.listdir(shm_dir) if n.startswith(prefixes))
