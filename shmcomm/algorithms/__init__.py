# SPDX-License-Identifier: Apache-2.0
"""Algorithms: how the collectives of a job are composed from transports (shmcomm/transport/).

- host.HostComm: the ranks of one host, one shared-memory transport;
- world.WorldComm: a job across hosts (or a logical grid on one host), composing the host's shared-memory transport
  with the 2D torus (torus2d.py: rows on shared memory, columns on MPI or shared memory), a ring (ring.py), or MPI's
  own collectives, each preceded by the agreement (agreement.py);
- choice.py decides which, once for the job and per call for `auto`."""
