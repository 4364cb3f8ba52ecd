# SPDX-License-Identifier: Apache-2.0
"""Which path CUDA tensors take, decided from every rank's description of its GPU.

NCCL needs a GPU of its own per rank: two ranks of a communicator on one device make ncclCommInitRank fail ("Duplicate
GPU detected"). So the ranks swap descriptions of their devices (`describe`) and every rank runs `choose_path` on the
same list, which makes the same choice everywhere: "nccl" when no two ranks of a host hold the same device and every
rank can load NCCL, "host" otherwise (the tensors are staged through pinned host memory into the shared-memory
collectives). SHMCOMM_GPU_PATH=nccl or host forces one (nccl where it cannot run is an error that names the ranks).
Everything but describe_torch_device is plain data, so that it is tested without a GPU."""
from shmcomm.vocabulary.exceptions import InvalidArgumentError

PATHS = ("auto", "nccl", "host")


def describe(host, index, uuid=None, pci_bus_id=None, nccl_problem=None):
    """A rank's device as every rank sees it: `index` is the CUDA ordinal in that process (which depends on
    CUDA_VISIBLE_DEVICES, so it does not identify the device); `uuid` and `pci_bus_id` do. `nccl_problem`: why this
    rank cannot load NCCL, or None when it can."""
    return {"host": str(host), "index": int(index), "uuid": uuid or None, "pci_bus_id": pci_bus_id or None,
            "nccl_problem": nccl_problem or None}


def describe_torch_device(torch, device, host, nccl_problem=None):
    """describe() of torch's CUDA `device` from its properties."""
    props = torch.cuda.get_device_properties(device)
    pci = getattr(props, "pci_bus_id", None)
    address = None if pci is None else "%04x:%02x:%02x" % (getattr(props, "pci_domain_id", 0), pci,
                                                           getattr(props, "pci_device_id", 0))
    return describe(host, device.index, str(getattr(props, "uuid", "") or ""), address, nccl_problem)


def identity(description):
    """What names the physical device: its UUID, else its PCI address, else (with neither known) the ordinal,
    which is right only when every rank sees every device (no CUDA_VISIBLE_DEVICES)."""
    for field in ("uuid", "pci_bus_id"):
        if description.get(field):
            return description["host"], field, str(description[field]).lower()
    return description["host"], "index", description["index"]


def shared_devices(descriptions):
    """[(ranks, description)] for every device that more than one rank holds, ranks in order."""
    holders = {}
    for rank, description in enumerate(descriptions):
        holders.setdefault(identity(description), []).append(rank)
    return [(ranks, descriptions[ranks[0]]) for key, ranks in sorted(holders.items(), key=lambda kv: kv[1][0])
            if len(ranks) > 1]


def choose_path(descriptions, requested="auto"):
    """("nccl" or "host", why): the same on every rank given the same `descriptions` (one per rank, in rank order)."""
    requested = (requested or "auto").lower()
    if requested not in PATHS:
        raise InvalidArgumentError("SHMCOMM_GPU_PATH=%r: choose one of %s" % (requested, ", ".join(PATHS)))
    shared = shared_devices(descriptions)
    if shared:
        ranks, description = shared[0]
        words = "ranks %s share the GPU %s on host %s" % (", ".join(map(str, ranks)), _device_text(description),
                                                          description["host"])
        if requested == "nccl":
            raise InvalidArgumentError("SHMCOMM_GPU_PATH=nccl, but %s, and NCCL needs a GPU per rank: give each rank "
                                       "its own device (torch.cuda.set_device(local_rank)) or use the host path"
                                       % words)
        return "host", words + ": staging through host memory"
    if requested == "host":
        return "host", "SHMCOMM_GPU_PATH=host"
    missing = [(rank, d["nccl_problem"]) for rank, d in enumerate(descriptions) if d.get("nccl_problem")]
    if missing:
        rank, problem = missing[0]
        words = "rank %d cannot load NCCL (%s)" % (rank, problem)
        if requested == "nccl":
            raise InvalidArgumentError("SHMCOMM_GPU_PATH=nccl, but %s" % words)
        return "host", words + ": staging through host memory"
    return "nccl", "every rank has a GPU of its own"


def _device_text(description):
    return description.get("uuid") or description.get("pci_bus_id") or "cuda:%d" % description["index"]
