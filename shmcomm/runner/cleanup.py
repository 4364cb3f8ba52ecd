# SPDX-License-Identifier: Apache-2.0
"""Removal of a job's shared-memory segments.

Ranks normally unlink their segment once everyone has attached, but a rank that dies early (or a job stopped
before all ranks attached) can leave files in /dev/shm that hold memory until reboot. The launcher calls this
after every job, whatever its outcome. MPICH's own node segments (`mpich_shm_*`, `mpich_vci_*`) are unlinked only by
MPI_Finalize, so a killed MPI job leaves them too: after an MPI job the launcher also removes those that appeared
during the job and that no live process still maps.
"""

import os
import re
import time

SHM_DIR = "/dev/shm"

# Same rule as the C core's job token. A '-' can never be part of a token, so the prefix below matches this
# job's segments and no other job's.
_TOKEN_PATTERN = re.compile(r"[A-Za-z0-9_]{8,64}\Z")


def segment_prefix(token: str) -> str:
    """The name prefix of the job's host segment on one host (`shmcomm-<token>-<generation>`); its other segments
    carry a suffix after the token (job_segment_pattern)."""
    if not _TOKEN_PATTERN.match(token):
        raise ValueError(f"invalid job token {token!r}: expected 8 to 64 characters of [A-Za-z0-9_]")
    return f"shmcomm-{token}-"


def job_segment_pattern(token: str) -> "re.Pattern":
    """The names of every segment of the job with this token: `shmcomm-<token><suffix>-<generation>`, where the
    suffix names a host across hosts (_h0), a process set (_s1), a grid's row or column (_r0, _c0), or is empty
    (startup/bootstrap.py). A token may hold '_', so the suffixes are matched exactly, not as a prefix: another job's
    token that starts with this one is not this job's."""
    segment_prefix(token)  # checks it
    return re.compile(rf"shmcomm-{re.escape(token)}(?:_[hsrc]\d+)?-\d+\Z")


def remove_job_segments(token: str, shm_dir: str = SHM_DIR) -> "list[str]":
    """Removes every segment of the job (job_segment_pattern) from shm_dir and returns the names removed (sorted)."""
    pattern = job_segment_pattern(token)
    try:
        names = os.listdir(shm_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in sorted(names):
        if not pattern.match(name):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue  # a rank removed it itself in the meantime
        except OSError:
            continue  # not ours to remove after all (a directory, another user's file)
        removed.append(name)
    return removed


MPICH_PREFIXES = ("mpich_shm_", "mpich_vci_")  # a node's segment, and its extra channels'


def _mapped_paths(proc_dir="/proc"):
    """Every file path a live process maps, among the processes whose maps this one may read (its user's)."""
    mapped = set()
    for pid in os.listdir(proc_dir):
        if not pid.isdigit():
            continue
        try:
            with open(os.path.join(proc_dir, pid, "maps")) as maps:
                for line in maps:
                    path = line.rstrip("\n").partition("/")[2]  # the fields before the path hold no '/'
                    if path.endswith(" (deleted)"):
                        path = path[:-len(" (deleted)")]
                    if path:
                        mapped.add("/" + path)
        except OSError:
            continue  # gone, or not ours to read
    return mapped


def remove_orphaned_mpi_segments(since: float, shm_dir: str = SHM_DIR, proc_dir: str = "/proc",
                                  linger_s: float = 0.0) -> "list[str]":
    """Removes this user's `mpich_shm_*` and `mpich_vci_*` files created at or after `since` (a time.time()) that no
    live process maps, and returns their names. A segment of another job still running is mapped by its ranks and
    stays. One still mapped is looked at again until `linger_s` has passed: a failed job's last ranks may still be
    exiting when the launcher gets here."""
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(MPICH_PREFIXES)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    candidates = []
    for name in names:
        path = os.path.join(shm_dir, name)
        try:
            info = os.stat(path)
        except OSError:
            continue
        if info.st_uid == os.getuid() and info.st_ctime >= since:
            candidates.append(path)
    deadline = time.monotonic() + linger_s
    removed = []
    while candidates:
        mapped = _mapped_paths(proc_dir)
        for path in sorted(candidates):
            if path in mapped:
                continue
            try:
                os.unlink(path)
            except OSError:
                pass
            else:
                removed.append(os.path.basename(path))
        candidates = [path for path in candidates if path in mapped]
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return removed
