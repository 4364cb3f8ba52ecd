# SPDX-License-Identifier: Apache-2.0
"""Start-up: who is in the job and where (topology.py, membership.py, devices.py), building the world communicator
(bootstrap.py) that the session holds (session.py), what the launcher says while MPI starts (notices.py), what a
failed rank leaves behind (failure_reports.py) and the library's logging (log.py)."""
