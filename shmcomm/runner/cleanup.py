# SPDX-License-Identifier: Apache-2.0
"""Removal of a job's shared-memory segments.

Ranks normally unlink their segment once everyone has attached, but a rank that dies early (or a job stopped
before all ranks attached) can leave files in /dev/shm that hold memory until reboot. The launcher calls this
after every job, whatever its outcome.
"""

import os
import re

SHM_DIR = "/dev/shm"

# Same rule as the C core's job token. A '-' can never be part of a token, so the prefix below matches this
# job's segments and no other job's.
_TOKEN_PATTERN = re.compile(r"[A-Za-z0-9_]{8,64}\Z")


def segment_prefix(token: str) -> str:
    """The name prefix shared by every shared-memory segment of the job with this token."""
    if not _TOKEN_PATTERN.match(token):
        raise ValueError(f"invalid job token {token!r}: expected 8 to 64 characters of [A-Za-z0-9_]")
    return f"shmcomm-{token}-"


def remove_job_segments(token: str, shm_dir: str = SHM_DIR) -> "list[str]":
    """Removes every `<shm_dir>/shmcomm-<token>-*` and returns the names removed (sorted)."""
    prefix = segment_prefix(token)
    try:
        names = os.listdir(shm_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in sorted(names):
        if not name.startswith(prefix):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue  # a rank removed it itself in the meantime
        except OSError:
            continue  # not ours to remove after all (a directory, another user's file)
        removed.append(name)
    return removed
