# SPDX-License-Identifier: Apache-2.0
"""Soft Memory Box storage in the shared-memory transport's arena (csrc/coll/box.c): named, typed buffers that every
rank of the host reads, writes and accumulates into under a robust per-box lock. box.py is the user's API
over this; client.RemoteBoxHandle is the same handle for a box in another host's arena (served there by
server.py), and stripes.py composes handles into a striped box."""
from shmcomm._native import check, ffi, lib

# The box that describes a striped box, int64 [count, dtype, stripes], is named with this after the box's name.
STRIPED_SUFFIX = ffi.string(lib.SMC_BOX_STRIPED_SUFFIX).decode()


def stripe_name(name, index):
    return "%s@%d" % (name, index)


def find_box(shm, name, timeout_s):
    """A handle to the box `name`, or to the description of the striped box of that name, waiting up to timeout_s
    for either to appear (smc_box_find): (handle, striped)."""
    out, striped = ffi.new("smc_box_t **"), ffi.new("int *")
    check(lib.smc_box_find(shm.handle, name.encode(), timeout_s, out, striped))
    return BoxHandle(shm, name + STRIPED_SUFFIX if striped[0] else name, found=out[0]), bool(striped[0])


class BoxHandle:
    """One process's handle to a box in `shm`'s arena (a transport.shm.SharedMemory with the arena)."""

    def __init__(self, shm, name, count=None, dtype=None, exist_ok=True, timeout_s=0.0, found=None):
        """With `count` and `dtype`: create the box (or attach to an equal one if exist_ok). Without: attach to a box
        another rank creates, waiting up to timeout_s for it. `found`: a handle find_box opened already."""
        self._shm = shm
        self._name = name.encode()
        out = ffi.new("smc_box_t **")
        if found is not None:
            out[0] = found
        elif count is not None:
            check(lib.smc_box_create(shm.handle, self._name, count, dtype, 1 if exist_ok else 0, out))
        else:
            check(lib.smc_box_attach(shm.handle, self._name, timeout_s, out))
        self._box = out[0]
        self.count = int(lib.smc_box_count(self._box))
        self.dtype = int(lib.smc_box_dtype(self._box))

    @property
    def closed(self):
        return self._box is None

    @property
    def detached(self):
        """The transport was shut down: the arena is gone."""
        return self._shm.handle == ffi.NULL

    def version(self):
        return int(lib.smc_box_version(self._box))

    def data(self, nbytes):
        """The box's memory itself, as a cffi buffer of nbytes."""
        return ffi.buffer(lib.smc_box_data(self._box), nbytes)

    def read(self, offset, count, dst):
        check(lib.smc_box_read(self._box, offset, count, dst, ffi.NULL))

    def write(self, offset, count, src):
        version = ffi.new("uint64_t *")
        check(lib.smc_box_write(self._box, offset, count, src, version))
        return int(version[0])

    def accumulate(self, offset, count, src, alpha, beta):
        version = ffi.new("uint64_t *")
        check(lib.smc_box_accumulate(self._box, offset, count, src, alpha, beta, version))
        return int(version[0])

    def exchange(self, offset, count, x_to_d, alpha):
        """Elastic averaging's exchange (smc_box_exchange): x_to_d holds x, then d = alpha * (x - c); c += d."""
        version = ffi.new("uint64_t *")
        check(lib.smc_box_exchange(self._box, offset, count, x_to_d, alpha, version))
        return int(version[0])

    def touch(self):
        """Bumps the version without changing an element."""
        version = ffi.new("uint64_t *")
        check(lib.smc_box_accumulate(self._box, 0, 0, ffi.NULL, 1.0, 1.0, version))
        return int(version[0])

    def lock(self, timeout_s):
        check(lib.smc_box_lock(self._box, timeout_s))

    def unlock(self):
        check(lib.smc_box_unlock(self._box))

    def wait_version(self, version, timeout_s):
        seen = ffi.new("uint64_t *")
        check(lib.smc_box_wait_version(self._box, version, timeout_s, seen))
        return int(seen[0])

    def close(self):
        if self._box is not None:
            if self._shm.handle != ffi.NULL:
                lib.smc_box_close(self._box)
            self._box = None

    def destroy(self):
        """Closes this handle and removes the name; the space is reused once every rank has closed its handle."""
        self.close()
        check(lib.smc_box_destroy(self._shm.handle, self._name))
