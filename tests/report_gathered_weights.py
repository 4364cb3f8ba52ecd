# SPDX-License-Identifier: Apache-2.0
"""Runs an example (`python tests/report_gathered_weights.py examples/x.py args...`) and prints, on every rank,
the sha256 of every tensor it allgathers, before the allgather. The examples gather their final weights to check
that the ranks agree; this lets the tests check it outside the library, on all the bytes."""
import hashlib
import os
import re
import runpy
import sys


def _reporting(allgather):
    def wrapper(tensor, *args, **kwargs):
        if hasattr(tensor, "detach"):
            data = tensor.detach().contiguous().numpy().tobytes()
        else:  # numpy, or jax (shmcomm.jax.allgather)
            import numpy as np

            data = np.ascontiguousarray(tensor).tobytes()
        print("gathered sha256 %s" % hashlib.sha256(data).hexdigest(), flush=True)
        return allgather(tensor, *args, **kwargs)
    return wrapper


def assert_same_on_every_rank(stdout, ranks):
    """The launcher's output of such a run: every rank gathered tensors with the same digests."""
    seen = {}
    for line in stdout.splitlines():
        match = re.match(r"\[(\d+)\]<stdout>: gathered sha256 ([0-9a-f]{64})\Z", line)
        if match:
            seen.setdefault(int(match.group(1)), []).append(match.group(2))
    assert sorted(seen) == list(range(ranks)), stdout
    assert seen[0] and all(digests == seen[0] for digests in seen.values()), seen


if __name__ == "__main__":
    import shmcomm

    shmcomm.allgather = _reporting(shmcomm.allgather)
    if os.path.basename(sys.argv[1]).startswith("jax"):  # examples/jax_*.py
        import shmcomm.jax as sj

        sj.allgather = _reporting(sj.allgather)
    else:
        import shmcomm.torch as hvd

        hvd.allgather = _reporting(hvd.allgather)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
