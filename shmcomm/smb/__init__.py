# SPDX-License-Identifier: Apache-2.0
"""The Soft Memory Box: named shared buffers every rank reads, writes and accumulates into (box.py), their storage in
the shared-memory arena (storage.py), boxes on other hosts (client.py, server.py, wire.py, stripes.py), the roll call
the box servers answer (rollcall.py), and elastic averaging over a box (averaging.py)."""
