# SPDX-License-Identifier: Apache-2.0
"""CPU-bound processes beside a test session or a benchmark, as on a training machine that is never idle (a data
loader, another job):

    with cpu_load.spinning(2):
        ...
"""
import contextlib
import os
import subprocess
import sys

_BUSY_LOOP = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:  # ends with the process that started it, however that ends
    for _ in range(1000000):
        pass
"""


@contextlib.contextmanager
def spinning(count):
    """Runs `count` processes that spin until the block ends (or this process dies)."""
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(os.getpid())], stdin=subprocess.DEVNULL)
            for _ in range(count)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()
