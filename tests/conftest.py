# SPDX-License-Identifier: Apache-2.0
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # the multiproc harness

try:
    # Once here, not in every rank: ranks forked by tests/multiproc.py inherit it, and the exact checks move bfloat16
    # as torch tensors (shmcomm/testing/exact.py).
    import torch  # noqa: F401
except ImportError:
    pass


def pytest_report_header(config):
    return "shmcomm tests: ranks are forked processes on one host (%d cores)" % (os.cpu_count() or 1)


def pytest_configure(config):
    # Every run lists its skips with their reasons (-rs): a skipped test must never pass for a passing one.
    if "s" not in config.option.reportchars and "a" not in config.option.reportchars:
        config.option.reportchars += "s"
