# SPDX-License-Identifier: Apache-2.0
"""Independent subprocesses of one test, run at the same time: each imports torch or jax, seconds of CPU with waits
for the disk between, which the others fill."""
import subprocess


def run_at_once(commands, timeout):
    """commands: (argv, Popen keyword arguments) pairs. Returns their CompletedProcess (text output) in that order;
    one still running after `timeout` is killed and comes back with what it printed."""
    running = [(argv, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs))
               for argv, kwargs in commands]
    done = []
    for argv, proc in running:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return done
