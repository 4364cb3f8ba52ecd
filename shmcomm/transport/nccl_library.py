# SPDX-License-Identifier: Apache-2.0
"""NCCL, found and bound at run time: shmcomm never compiles or links against it.

`load()` looks for `libnccl.so.2` (find() says where), binds the calls shmcomm uses through cffi's ABI mode (no
compiler, no headers) and checks the version; `non_blocking_config()` asks for communicators whose calls never block. Everything here runs without a GPU: the version, the error strings and
a unique id need none; communicators and collectives need a device."""
import ctypes.util
import functools
import importlib.metadata
import os
import sys

import cffi

from shmcomm import env
from shmcomm.vocabulary.exceptions import ShmCommError

SETTING = "SHMCOMM_NCCL_LIBRARY"
WHEELS = {12: "nvidia-nccl-cu12", 13: "nvidia-nccl-cu13"}  # by the CUDA major they are built for
# ncclCommSplit, which builds the 2D torus's rows and columns from one world communicator, came with NCCL 2.18.
OLDEST = (2, 18, 0)

DECLARATIONS = """
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm* ncclComm_t;
typedef void* cudaStream_t;
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char* netName;
    int splitShare;
} ncclConfig_t;
ncclResult_t ncclGetVersion(int* version);
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
const char* ncclGetErrorString(ncclResult_t result);
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
"""

# ncclResult_t values that mean "not finished yet" rather than failure (ncclInProgress, NCCL 2.14 and later).
IN_PROGRESS = 7
# nccl.h's ncclDataType_t and ncclRedOp_t.
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
          "float64": 8, "bfloat16": 9}
OPS = {"sum": 0, "product": 1, "max": 2, "min": 3, "average": 4}
# ncclConfig_t is versioned: NCCL reads `size` bytes of it and gives every field newer than `version` its default.
# The fields declared above are those of NCCL 2.18, the oldest release shmcomm takes.
CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_VERSION = 21800
CONFIG_UNDEF_INT = -(2 ** 31)


class NcclError(ShmCommError):
    """NCCL is missing, too old, or one of its calls failed. ``result`` is NCCL's code where a call failed."""

    def __init__(self, message, result=None):
        super().__init__(message)
        self.result = result


def version_tuple(code):
    """NCCL's version code as (major, minor, patch): 2.9 and later encode it as major*10000 + minor*100 + patch."""
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


class NcclLibrary:
    """One loaded libnccl: `path`, `found_by` (which of the places find() looks in), `version` and the bound calls.

    `check(result, what, comm=None)` turns a non-zero ncclResult_t into NcclError with NCCL's own words (its last
    error message where it has one)."""

    def __init__(self, path, found_by):
        self.ffi = cffi.FFI()
        self.ffi.cdef(DECLARATIONS)
        try:
            self.lib = self.ffi.dlopen(path)
        except OSError as error:
            raise NcclError(f"cannot load NCCL from {path} ({found_by}): {error}") from None
        self.path, self.found_by = path, found_by
        code = self.ffi.new("int*")
        self.check(self.lib.ncclGetVersion(code), "ncclGetVersion")
        self.version = version_tuple(code[0])
        if self.version < OLDEST:
            raise NcclError("NCCL %s at %s (%s) is too old: shmcomm needs %s or later"
                            % (self.version_text, path, found_by, ".".join(map(str, OLDEST))))

    @property
    def version_text(self):
        return ".".join(map(str, self.version))

    def error_string(self, result):
        return self.ffi.string(self.lib.ncclGetErrorString(result)).decode(errors="replace")

    def check(self, result, what, comm=None):
        if result == 0:
            return
        message = f"{what} failed: {self.error_string(result)} (NCCL error {result})"
        last = self.lib.ncclGetLastError(comm if comm is not None else self.ffi.NULL)
        detail = self.ffi.string(last).decode(errors="replace").strip() if last != self.ffi.NULL else ""
        if detail:
            message += f": {detail}"
        raise NcclError(message, result)

    def non_blocking_config(self):
        """An ncclConfig_t that asks for a non-blocking communicator (blocking = 0): its creation, split, collectives
        and group ends return ncclInProgress instead of waiting inside NCCL (for peers, or for the connections NCCL
        makes at the first collective), so that every wait is the caller's and bounded. Other fields: NCCL's
        defaults."""
        config = self.ffi.new("ncclConfig_t*")
        config.size = self.ffi.offsetof("ncclConfig_t", "splitShare") + self.ffi.sizeof("int")
        config.magic, config.version, config.blocking = CONFIG_MAGIC, CONFIG_VERSION, 0
        config.cgaClusterSize = config.minCTAs = config.maxCTAs = config.splitShare = CONFIG_UNDEF_INT
        config.netName = self.ffi.NULL
        return config

    def unique_id(self):
        """A new communicator id (128 bytes) for rank 0 to hand to the others; needs no GPU."""
        uid = self.ffi.new("ncclUniqueId*")
        self.check(self.lib.ncclGetUniqueId(uid), "ncclGetUniqueId")
        return bytes(self.ffi.buffer(uid))


def torch_cuda_major():
    """The CUDA major version of the torch this process imported, or None (no torch yet, or a CPU build)."""
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        return int(str(version).split(".")[0]) if version else None
    except ValueError:
        return None


def wheel_order(cuda_major):
    """The NCCL wheels to try, by name: the one built for `cuda_major` first, then older ones, never a newer one
    (a library built for a newer CUDA than torch's may need a newer driver); without a CUDA major, oldest first."""
    if cuda_major is None:
        return [WHEELS[major] for major in sorted(WHEELS)]
    return [WHEELS[major] for major in sorted(WHEELS, reverse=True) if major <= cuda_major]


def _from_wheels(cuda_major=None):
    for wheel in wheel_order(cuda_major):
        try:
            files = importlib.metadata.distribution(wheel).files or ()
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in files:
            if file.name == "libnccl.so.2":
                path = str(file.locate())
                if os.path.exists(path):
                    return path, f"the {wheel} wheel"
    return None


def _already_mapped():
    """A libnccl that this process has loaded already (torch's, for one), read from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libnccl.so"):
                    return path, "the copy already loaded in this process"
    except OSError:
        pass
    return None


def _on_loader_path():
    name = ctypes.util.find_library("nccl")
    return (name, "the dynamic loader's search path") if name else None


def find():
    """(path, found_by) of the library `load()` would take, or None. In this order:
    1. SHMCOMM_NCCL_LIBRARY, a path (an error if it is set and does not load: the user asked for that file);
    2. a copy already mapped into this process (torch loads its NCCL when torch.distributed starts): one NCCL per
       process, the one torch was built with;
    3. the `nvidia-nccl-cu12` and `nvidia-nccl-cu13` wheels in wheel_order() of the running torch's CUDA major
       (torch_cuda_major()), found through the wheel's own file list so that a change of layout inside the wheel does
       not lose it;
    4. the dynamic loader's search path (a system install)."""
    chosen = env.nccl_library()
    if chosen:
        return chosen, SETTING
    found = _already_mapped() or _from_wheels(torch_cuda_major()) or _on_loader_path()
    return found or None


@functools.lru_cache(maxsize=None)
def _load(path, found_by):
    return NcclLibrary(path, found_by)


def load():
    """The NCCL library (loaded once per path), or NcclError saying where it looked."""
    found = find()
    if found is None:
        major = torch_cuda_major()
        wheel = WHEELS[major] if major in WHEELS else " or ".join("%s (CUDA %d)" % (WHEELS[m], m) for m in WHEELS)
        raise NcclError("NCCL not found: set %s to libnccl.so.2, or install the NCCL wheel of torch's CUDA: pip "
                        "install %s" % (SETTING, wheel))
    return _load(*found)


def load_problem():
    """Why load() fails in this process (its error's words), or None when NCCL loads."""
    try:
        load()
    except NcclError as error:
        return str(error)
    return None
