# SPDX-License-Identifier: Apache-2.0
"""torch.distributed on the shmcomm backend (`init_process_group("shmcomm")`) as a benchmark backend: the same calls as
gloo's, so that the two compare like for like and against shmcomm's own numpy-level API."""
import torch

import shmcomm.torch  # noqa: F401  (registers the backend)
from benchmarks.backend_gloo import GlooBackend


class TorchShmcommBackend(GlooBackend):
    name = "torch_shmcomm"
    process_group = "shmcomm"

    def __init__(self, port, **options):
        super().__init__(port, **options)
        self.library = "torch %s, shmcomm backend" % torch.__version__
