# SPDX-License-Identifier: Apache-2.0
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # the multiproc harness


def pytest_report_header(config):
    return "shmcomm tests: ranks are forked processes on one host (%d cores)" % (os.cpu_count() or 1)
