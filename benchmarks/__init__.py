# SPDX-License-Identifier: Apache-2.0
"""Microbenchmarks of shmcomm against MPI, gloo and a plain memory copy (nccl-tests conventions)."""
