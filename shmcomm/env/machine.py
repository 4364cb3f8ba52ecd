# SPDX-License-Identifier: Apache-2.0
"""What this machine reports about itself, for settings tuned at run time rather than fitted on one box."""
import os


def cache_bytes(level=2):
    """The size of this core's level-`level` data or unified cache, as the kernel reports it; None if unknown."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(root)):
            base = os.path.join(root, index)
            with open(os.path.join(base, "level")) as f, open(os.path.join(base, "type")) as t:
                if int(f.read()) != level or t.read().strip() == "Instruction":
                    continue
            with open(os.path.join(base, "size")) as f:
                text = f.read().strip()
            return int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text)
    except (OSError, ValueError, KeyError):
        pass
    return None
