# SPDX-License-Identifier: Apache-2.0
"""Things compiled on first use (shmcomm.jax's XLA handler, the CUDA kernels), built once per machine into a cache
directory and shared by every rank and every later run.

A build goes to `root/key`, where `key` digests what went into it (sources, headers, compiler), so a change of any
of them builds anew and an unchanged one is loaded at once. The ranks of a job start together: a file lock lets one
build while the others wait, and the result appears atomically (built in a scratch directory, then renamed), so a
rank never sees half a build, also after a crash mid-build."""
import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from shmcomm import env


def cache_dir(name):
    """SHMCOMM_BUILD_DIR/`name`, else ~/.cache/shmcomm/`name` (XDG_CACHE_HOME honoured)."""
    return Path(env.build_dir(name))


def built(root, key, build):
    """root/key, after `build(work)` has filled the empty directory `work` with the build (only if no build of
    `key` exists yet). Exceptions of `build` propagate; nothing is left behind then."""
    target = Path(root) / key
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank builds; the others wait here, then find it built
        if not target.exists():
            scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
            try:
                work = scratch / "module"
                work.mkdir()
                build(work)
                os.replace(work, target)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return target


def imported(target, name):
    """The Python extension module `name` that a build put in the directory `target` (cffi's compiled modules)."""
    (path,) = Path(target).glob(name + "*")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
