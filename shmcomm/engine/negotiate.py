# SPDX-License-Identifier: Apache-2.0
"""Agreement across ranks on what to run next.

Each cycle every rank publishes what it has pending (allgather), and every rank then computes the same verdict from
the same data: which requests every member of their process set has submitted, in one order (first appearance,
scanning rank 0 up), and which of those disagree. A request that disagrees fails on every rank with a message naming
the ranks and what differed; the others run. Requests agreed once travel as cache ids afterwards (Negotiator), so
steady-state training costs a few integers per tensor per cycle."""
import pickle
from typing import NamedTuple

from shmcomm.vocabulary import description
from shmcomm.vocabulary.buffers import output_for, require_reducible, wrap, wrap_device
from shmcomm.vocabulary.exceptions import InvalidArgumentError


class Signature(NamedTuple):
    """What all ranks must agree on for a request: its process set and what it is (description.Collective).
    `refused`: the error of this rank's own checks, which fails the request on every rank."""
    set_key: object
    collective: description.Collective
    refused: str = None


def set_key(req):
    """0 for everyone; (id, member ranks) for a process set. Carrying the members lets every rank judge readiness
    without having registered the set itself (a rank outside the set may register it later than the members)."""
    return 0 if req.set_id == 0 else (req.set_id, tuple(req.comm.ranks))


def members_of(key, size):
    return range(size) if key == 0 else key[1]


def signature(req, buf_key, shape):
    return Signature(set_key(req), description.describe(req.kind, buf_key, shape, req.op, req.prescale,
                                                        req.postscale, req.root))


def refusal(req, reason):
    """The signature of a request whose arguments failed this rank's checks: it is negotiated like any other, and
    fails on every rank, naming this one and `reason`."""
    return Signature(set_key(req), description.describe(req.kind), reason)


class Response:
    __slots__ = ("name", "sig", "error", "joined", "refused_by")

    def __init__(self, name, sig, error=None, joined=(), refused_by=None):
        self.name = name
        self.sig = sig
        self.error = error        # text: this request fails on every rank
        self.joined = joined      # ranks that contribute zeros (they called join())
        self.refused_by = refused_by  # the first rank whose own checks refused it (then `error` says why)


def _split(blob):
    """A rank's message -> (its pending list as sent, its flags as sent)."""
    end = 4 + int.from_bytes(blob[:4], "little")
    return blob[4:end], blob[end:]


class Plan:
    """A cycle's verdict: the agreed responses, in order, and what the engine derives from them (`steps`, filled in
    by the engine). Reused while the ranks keep sending the same message."""
    __slots__ = ("responses", "steps")

    def __init__(self, responses):
        self.responses = responses
        self.steps = None


class Negotiator:
    """A request travels as (name, signature) the first time; once agreed it gets a cache id, identical on every rank
    because every rank assigns ids in the same order, and later cycles send only the id. When every rank sends the
    very same message of cached ids, nothing is left to judge: the verdict for that message is remembered (a Plan)
    and reused as it is."""
    MAX_PLANS = 64  # distinct steady states remembered (a training loop has one or a few)

    def __init__(self, comm, cache_capacity):
        self.comm = comm
        self.capacity = cache_capacity
        self.ids = {}     # (name, sig) -> cache id
        self.entries = []  # cache id -> (name, sig)
        self.plans = {}   # pending list as sent -> Plan, for lists made only of cache ids
        self._uniform = None  # this cycle's pending list as sent, when every rank sent it and it holds only cache ids

    def exchange(self, pending, flags):
        """Publishes [(name, sig)] and a flags dict; returns every rank's (entries, flags)."""
        ids = [self.ids.get(item, item) for item in pending]
        wire = pickle.dumps(ids, protocol=pickle.HIGHEST_PROTOCOL)
        gathered = self.comm.allgather_bytes(len(wire).to_bytes(4, "little") + wire +
                                             pickle.dumps(flags, protocol=pickle.HIGHEST_PROTOCOL))
        split = [_split(blob) for blob in gathered]
        self._uniform = None
        if all(peer_wire == wire for peer_wire, _ in split):  # the steady state: only the flags need decoding
            if all(isinstance(i, int) for i in ids):
                self._uniform = wire
            return [(pending, pickle.loads(peer_flags)) for _, peer_flags in split]
        return [([self.entries[w] if isinstance(w, int) else w for w in pickle.loads(peer_wire)],
                 pickle.loads(peer_flags)) for peer_wire, peer_flags in split]

    def agree(self, everyone, joined):
        """A Plan whose responses are in the same order on every rank, and {name: (first_submitters, missing ranks)}
        still waiting."""
        if self._uniform is not None and not joined:
            plan = self.plans.get(self._uniform)
            if plan is None:
                if len(self.plans) >= self.MAX_PLANS:
                    self.plans.clear()
                plan = self.plans[self._uniform] = Plan(self._judge(everyone, joined)[0])
            return plan, {}
        responses, waiting = self._judge(everyone, joined)
        return Plan(responses), waiting

    def _judge(self, everyone, joined):
        order, seen = [], {}
        for rank, (entries, _) in enumerate(everyone):
            for name, sig in entries:
                if name not in seen:
                    seen[name] = {}
                    order.append(name)
                seen[name][rank] = sig
        responses, waiting = [], {}
        for name in order:
            by_rank = seen[name]
            sig = next(iter(by_rank.values()))
            members = members_of(sig.set_key, len(everyone))
            missing = [r for r in members if r not in by_rank and r not in joined]
            if missing:
                waiting[name] = (sorted(by_rank), missing)
                continue
            zeros = tuple(r for r in members if r not in by_rank)
            refused = sorted(r for r, s in by_rank.items() if s.refused is not None)
            if refused:
                responses.append(Response(name, sig, _refusal_text(name, by_rank, refused), zeros, refused[0]))
            else:
                responses.append(Response(name, sig, self._disagreement(name, by_rank, zeros), zeros))
        for resp in responses:
            if resp.error is None:
                self._remember(resp.name, resp.sig)
        return responses, waiting

    @staticmethod
    def _disagreement(name, by_rank, zeros):
        sig = next(iter(by_rank.values()))
        # Cached entries decode to the very same tuple on every rank, so identity settles the usual case cheaply.
        if any(s is not sig and s != sig for s in by_rank.values()):
            every = {r: s.collective for r, s in by_rank.items()}
            return "%s: ranks disagree: %s" % (name, description.listing(every))
        if zeros and sig.collective.kind != "allreduce":
            return ("%s: ranks %s have called join(); only allreduce can go on without them"
                    % (name, ", ".join(str(r) for r in zeros)))
        return None

    def _remember(self, name, sig):
        key = (name, sig)
        if key not in self.ids and len(self.entries) < self.capacity:
            self.ids[key] = len(self.entries)
            self.entries.append(key)


def _refusal_text(name, by_rank, refused):
    """What every rank says of a request that failed the checks of the ranks `refused`: the words of the core's
    own refusals (csrc/coll/step.c)."""
    return "%s: rank %d's call failed its own checks%s, so no rank ran it; %s" % (
        name, refused[0], " (and other ranks' too)" if len(refused) > 1 else "",
        "; ".join("rank %d: %s" % (r, by_rank[r].refused) for r in refused))


def checked_signature(req):
    """The request's signature, after the checks a communicator would make when running it."""
    if req.error is not None:
        raise req.error
    if req.kind == "barrier":
        return signature(req, None, ())
    on_device = getattr(req.comm, "on_device", False)  # algorithms/device.py: CUDA tensors
    buf = req.buffer = (wrap_device(req.tensor, req.what) if on_device else
                        wrap(req.tensor, req.what, writable=req.output is req.tensor))
    if req.kind in ("allreduce", "reducescatter"):
        require_reducible(buf, req.what)
    if req.kind == "reducescatter" and not buf.shape:
        raise InvalidArgumentError("%s: a tensor with at least one dimension is required" % req.what)
    # An allgather's or alltoall's result shape is known only once the ranks meet; a reduce-scatter's share is
    # checked when it runs; those ranks take part with a scratch array and raise then (output_or_scratch).
    if (req.output is not None and req.output is not req.tensor and req.kind in ("allreduce", "broadcast") and
            not on_device):  # a device output is checked by DeviceComm.prepare
        output_for(buf, req.output, buf.shape, req.what)
    return signature(req, buf.dtype_key(), tuple(buf.shape) or (1,))


def plan_text(steps):
    """A plan in words for the debug log: 'fused allreduce [a, b]; broadcast c; error d'."""
    parts = []
    for kind, item in steps:
        if kind == "fused":
            parts.extend("fused allreduce [%s]" % ", ".join(r.name for r in group) for group in item)
        else:
            parts.append("%s %s" % ("error" if kind == "error" else item.sig.collective.kind, item.name))
    return "; ".join(parts)
