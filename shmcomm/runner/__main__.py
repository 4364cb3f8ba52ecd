# SPDX-License-Identifier: Apache-2.0
"""`python -m shmcomm.runner`, the same as the shmcommrun command."""

import sys

from . import main

sys.exit(main())
