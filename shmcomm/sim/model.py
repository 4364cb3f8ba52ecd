# SPDX-License-Identifier: Apache-2.0
"""The alpha-beta-gamma model of all-reduce: flat ring, 2D torus, hierarchical and parameter-server star.

Every algorithm is reduced to five coefficients, one per model parameter (TERMS), so that
time = coefficients @ machine.parameters. Latency coefficients count steps, bandwidth coefficients count the
bytes a rank pushes through its slowest link in each step, and the gamma coefficient counts the bytes a rank
reduces. Calibration fits the parameters from measured times with the same coefficients. Sizes are continuous:
the padding of M to a multiple of X is left out. Machine says how ranks, hosts and links are laid out.
"""
from dataclasses import dataclass, replace
from typing import List, NamedTuple, Tuple

import numpy as np

ALGORITHMS = ("ring", "torus", "torus-small", "hierarchical", "star")
TERMS = ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma")


@dataclass(frozen=True)
class LinkModel:
    """One kind of link: alpha_s seconds per message, beta_s_per_byte seconds per byte (1 / bandwidth)."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self):
        for name in ("alpha_s", "beta_s_per_byte"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError("LinkModel.%s must be finite and >= 0, got %r" % (name, value))

    @classmethod
    def from_bandwidth(cls, latency_s: float, bandwidth_bytes_per_s: float) -> "LinkModel":
        if not bandwidth_bytes_per_s > 0:
            raise ValueError("bandwidth must be > 0 bytes/s, got %r" % (bandwidth_bytes_per_s,))
        return cls(latency_s, 1.0 / bandwidth_bytes_per_s)

    @property
    def latency(self) -> float:
        return self.alpha_s

    @property
    def bandwidth(self) -> float:
        """Bytes per second; infinite for a link whose bytes cost nothing."""
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")


@dataclass(frozen=True)
class Machine:
    """`ranks` ranks, `local` per host; `intra` links ranks of one host, `inter` is one host's NIC.

    Ranks are numbered host by host: rank r lives on host r // local. A torus grid X x Y puts rank r in row r // X
    and column r % X, so rows stay inside a host when X divides local, and span X / local hosts when local divides
    X. Each host has one NIC (the inter link, its bandwidth per direction, full duplex), which every rank of the host
    that sends across hosts at the same time shares equally. Shared memory (the intra link) is taken per rank pair."""

    ranks: int
    local: int
    intra: LinkModel
    inter: LinkModel
    gamma_s_per_byte: float = 0.0

    def __post_init__(self):
        if self.ranks < 1 or self.local < 1:
            raise ValueError("ranks and local must be >= 1, got %d and %d" % (self.ranks, self.local))
        if self.ranks % self.local:
            raise ValueError("ranks (%d) must be a multiple of local (%d): hosts are modelled as equal"
                             % (self.ranks, self.local))
        if not (np.isfinite(self.gamma_s_per_byte) and self.gamma_s_per_byte >= 0):
            raise ValueError("gamma_s_per_byte must be finite and >= 0, got %r" % (self.gamma_s_per_byte,))

    @property
    def hosts(self) -> int:
        return self.ranks // self.local

    @property
    def parameters(self) -> np.ndarray:
        """The model parameters in the order of TERMS."""
        return np.array([self.intra.alpha_s, self.intra.beta_s_per_byte, self.inter.alpha_s,
                         self.inter.beta_s_per_byte, self.gamma_s_per_byte])

    def with_parameters(self, parameters) -> "Machine":
        alpha_h, beta_h, alpha_v, beta_v, gamma = (float(p) for p in parameters)
        return replace(self, intra=LinkModel(alpha_h, beta_h), inter=LinkModel(alpha_v, beta_v),
                       gamma_s_per_byte=gamma)


class Prediction(NamedTuple):
    algorithm: str  # a label that parse_algorithm reads back: "ring", "torus 4x272", "hierarchical", "star"
    seconds: float
    steps: int
    inter_bytes_per_rank: float  # the most any one rank sends across hosts


def _ring_phase(machine: Machine, next_rank: np.ndarray, nsteps: int, chunk_bytes: float):
    """`nsteps` lockstep steps in which rank r sends chunk_bytes to next_rank[r] (several rings at once).

    A step lasts as long as its slowest hop: an intra hop costs alpha_h + c*beta_h; a hop across hosts costs
    alpha_v + c*s*beta_v, where s is the largest number of such hops leaving or entering one host (its NIC is
    split s ways). Returns the coefficients and the bytes each rank sends across hosts."""
    ranks = np.arange(machine.ranks)
    host = ranks // machine.local
    crossing = host != host[next_rank]
    moving = next_rank != ranks
    if nsteps == 0 or not moving.any():
        return np.zeros(len(TERMS)), np.zeros(machine.ranks)
    candidates = []
    if (moving & ~crossing).any():
        candidates.append(np.array([1.0, chunk_bytes, 0.0, 0.0, 0.0]))
    if crossing.any():
        streams = max(np.bincount(host[crossing]).max(), np.bincount(host[next_rank][crossing]).max())
        candidates.append(np.array([0.0, 0.0, 1.0, chunk_bytes * streams, 0.0]))
    step = max(candidates, key=lambda coefficients: float(coefficients @ machine.parameters))
    return nsteps * step, nsteps * chunk_bytes * crossing


def default_grid(machine: Machine) -> Tuple[int, int]:
    """Rows = the ranks of one host, columns = the same local rank across hosts."""
    return machine.local, machine.hosts


def _check_grid(machine: Machine, grid) -> Tuple[int, int]:
    columns, rows = grid if grid is not None else default_grid(machine)
    if columns < 1 or rows < 1 or columns * rows != machine.ranks:
        raise ValueError("grid %dx%d does not cover %d ranks (X*Y must equal ranks)" % (columns, rows, machine.ranks))
    return int(columns), int(rows)


# Flat ring over N ranks: reduce-scatter then all-gather, N-1 steps each of M/N bytes, one reduction a step:
#   T = 2(N-1)(alpha + M/N beta) + (N-1)/N M gamma, (alpha, beta) those of the slowest hop: the inter link once the
#   ring leaves a host. Each host boundary is crossed by one rank pair, which has the NIC to itself.
def _ring(machine: Machine, nbytes: float):
    n = machine.ranks
    coefficients, inter_bytes = _ring_phase(machine, (np.arange(n) + 1) % n, 2 * (n - 1), nbytes / n)
    coefficients[4] += (n - 1) / n * nbytes
    return coefficients, inter_bytes.max()


# 2D torus X x Y: reduce-scatter along rows (X-1 steps of M/X), all-reduce along columns on the M/X shard
# (2(Y-1) steps of M/(XY)), all-gather along rows (X-1 steps of M/X). With rows inside hosts (X = local):
#   T = 2(X-1)(alpha_h + M/X beta_h) + 2(Y-1)(alpha_v + M/(XY) X beta_v) + ((X-1)/X + (Y-1)/(XY)) M gamma.
#   The X on beta_v: all X ranks of a host run their column rings at once through the one NIC, 1/X of it each.
# Rows spanning hosts (X > local) are bounded by the inter link instead, with one row hop per host boundary; the
# columns then share each NIC `local` ways. _ring_phase counts these for any layout.
def _torus(machine: Machine, nbytes: float, grid=None):
    columns, rows = _check_grid(machine, grid)
    rank = np.arange(machine.ranks)
    row, column = np.divmod(rank, columns)
    next_in_row = row * columns + (column + 1) % columns
    next_in_column = ((row + 1) % rows) * columns + column
    row_coefficients, row_inter = _ring_phase(machine, next_in_row, 2 * (columns - 1), nbytes / columns)
    column_coefficients, column_inter = _ring_phase(machine, next_in_column, 2 * (rows - 1), nbytes / machine.ranks)
    coefficients = row_coefficients + column_coefficients
    coefficients[4] += ((columns - 1) / columns + (rows - 1) / machine.ranks) * nbytes
    return coefficients, (row_inter + column_inter).max()


# The torus's path for small messages (shmcomm takes it up to SHMCOMM_TORUS_SMALL_BYTES): the row allreduces all
# M bytes in one shared-memory step, one rank per host allreduces them across hosts by recursive doubling (MPI's
# algorithm for short messages, which shmcomm runs inside its cross-host agreement: log2(H) exchanges, two more when
# H is not a power of two), and the row takes the result from it in one more step:
#   T = 2 alpha_h + 2M beta_h + s (alpha_v + M beta_v) + (L - 1 + s) M gamma,  s = the exchanges across hosts.
def _torus_small(machine: Machine, nbytes: float):
    local, hosts = machine.local, machine.hosts
    exchanges = _doubling_steps(hosts)
    coefficients = np.array([0.0, 0.0, float(exchanges), exchanges * nbytes, (local - 1 + exchanges) * nbytes])
    if local > 1:
        coefficients[:2] += [2.0, 2 * nbytes]
    return coefficients, exchanges * nbytes


def _doubling_steps(n: int) -> int:
    if n <= 1:
        return 0
    power = n.bit_length() - 1
    return power if n == 1 << power else power + 2


# Hierarchical: reduce to one root per host, ring all-reduce across the H roots, broadcast inside the host.
# Reduce and broadcast are pipelined chains: L-1 hops of latency and M bytes streamed once (fill time left out):
#   T = 2(L-1) alpha_h + 2M beta_h + M gamma + 2(H-1)(alpha_v + M/H beta_v) + (H-1)/H M gamma.
#   Only the root sends across hosts, so it has the NIC to itself, but it moves `local` times a torus rank's bytes.
def _hierarchical(machine: Machine, nbytes: float):
    local, hosts = machine.local, machine.hosts
    coefficients = np.zeros(len(TERMS))
    if local > 1:
        coefficients += [2 * (local - 1), 2 * nbytes, 0.0, 0.0, nbytes]
    if hosts > 1:
        coefficients += [0.0, 0.0, 2 * (hosts - 1), 2 * (hosts - 1) / hosts * nbytes, (hosts - 1) / hosts * nbytes]
    return coefficients, 2 * (hosts - 1) / hosts * nbytes


# Parameter server / Soft Memory Box star, k servers striping the buffer: every rank pushes M, then pulls the sum.
# The pull waits for the sum, so the two phases add: a server's link moves N M/k each way, a worker host's NIC L M:
#   T = 2 alpha_v + max(2 N M/k, 2 L M) beta_v + N M/k gamma (the servers accumulate what arrives).
#   Servers are hosts of their own behind an inter link, as SMB's memory server is.
def _star(machine: Machine, nbytes: float, servers: int = 1):
    if servers < 1:
        raise ValueError("servers must be >= 1, got %d" % servers)
    per_server = machine.ranks * nbytes / servers
    coefficients = np.array([0.0, 0.0, 2.0, 2 * max(per_server, machine.local * nbytes), per_server])
    return coefficients, 2.0 * nbytes


def parse_algorithm(label: str):
    """'ring', 'torus', 'torus 4x272', 'hierarchical', 'star' or 'star 8' -> (name, grid, servers), None if unsaid."""
    name, _, argument = label.strip().replace(":", " ").partition(" ")
    argument = argument.strip()
    try:
        if name == "torus" and argument:
            columns, rows = argument.lower().split("x")
            return name, (int(columns), int(rows)), None
        if name == "star" and argument:
            return name, None, int(argument)
    except ValueError:
        pass
    else:
        if name in ALGORITHMS and not argument:
            return name, None, None
    raise ValueError("unknown algorithm %r: use one of ring, torus, torus XxY, torus-small, hierarchical, star, star K"
                     % label)


def cost_terms(algorithm: str, machine: Machine, nbytes: float, grid=None, servers: int = 1):
    """(coefficients in the order of TERMS, most bytes one rank sends across hosts) for one all-reduce of nbytes."""
    name, label_grid, label_servers = parse_algorithm(algorithm)
    if name == "ring":
        return _ring(machine, nbytes)
    if name == "torus":
        return _torus(machine, nbytes, grid or label_grid)
    if name == "torus-small":
        return _torus_small(machine, nbytes)
    if name == "hierarchical":
        return _hierarchical(machine, nbytes)
    return _star(machine, nbytes, servers if label_servers is None else label_servers)


def steps(algorithm: str, machine: Machine, grid=None) -> int:
    """Latency steps: ring 2(N-1), torus 2(X-1)+2(Y-1), torus-small 2 + log2(H) (+2 when H is not a power of two),
    hierarchical 2(L-1)+2(H-1), star 2 (push, pull)."""
    name, label_grid, _ = parse_algorithm(algorithm)
    if name == "ring":
        return 2 * (machine.ranks - 1)
    if name == "torus":
        columns, rows = _check_grid(machine, grid or label_grid)
        return 2 * (columns - 1) + 2 * (rows - 1)
    if name == "torus-small":
        return (2 if machine.local > 1 else 0) + _doubling_steps(machine.hosts)
    if name == "hierarchical":
        return 2 * (machine.local - 1) + 2 * (machine.hosts - 1)
    return 2


def ring_time(machine: Machine, nbytes: float) -> float:
    return float(_ring(machine, nbytes)[0] @ machine.parameters)


def torus_time(machine: Machine, nbytes: float, grid=None) -> float:
    return float(_torus(machine, nbytes, grid)[0] @ machine.parameters)


def hierarchical_time(machine: Machine, nbytes: float) -> float:
    return float(_hierarchical(machine, nbytes)[0] @ machine.parameters)


def star_time(machine: Machine, nbytes: float, servers: int = 1) -> float:
    return float(_star(machine, nbytes, servers)[0] @ machine.parameters)


def inter_host_bytes(algorithm: str, machine: Machine, nbytes: float, grid=None, servers: int = 1) -> float:
    """The most bytes any one rank sends across hosts in one all-reduce."""
    return float(cost_terms(algorithm, machine, nbytes, grid, servers)[1])


def best_grid(machine: Machine, nbytes: float) -> Tuple[int, int]:
    """The grid X x Y = N with the least predicted torus time; ties go to the X nearest to local."""
    divisors = [x for x in range(1, machine.ranks + 1) if machine.ranks % x == 0]
    columns = min(divisors, key=lambda x: (torus_time(machine, nbytes, (x, machine.ranks // x)),
                                           abs(x - machine.local)))
    return columns, machine.ranks // columns


def predict(machine: Machine, nbytes: float, grid=None, servers: int = 1) -> List[Prediction]:
    """Ring, torus on the default grid, torus on the best grid (and on `grid`), the torus's small-message path,
    hierarchical, star. The torus reduce-scatters along rows inside a host, all-reduces along columns across hosts
    and all-gathers along rows; hierarchical reduces to a root per host, rings across the roots and broadcasts.

        abci = Machine(ranks=1088, local=4,
                       intra=LinkModel.from_bandwidth(0.5e-6, 50e9),   # shared memory / NVLink inside a host
                       inter=LinkModel.from_bandwidth(2e-6, 12.5e9),   # one host's NIC, shared by its ranks
                       gamma_s_per_byte=0.1e-9)                        # cost of reducing one byte
        for algorithm, seconds, steps, inter_bytes in predict(abci, 100 * 2**20):
            print(algorithm, seconds, steps, inter_bytes)
        best_grid(abci, 100 * 2**20)                                   # (X, Y) with X * Y == 1088
    """
    grids = [default_grid(machine), best_grid(machine, nbytes)]
    if grid is not None:
        grids.append(_check_grid(machine, grid))
    labels = ["ring"] + ["torus %dx%d" % g for g in dict.fromkeys(grids)] + ["torus-small", "hierarchical"]
    labels.append("star" if servers == 1 else "star %d" % servers)
    predictions = []
    for label in labels:
        coefficients, inter_bytes = cost_terms(label, machine, nbytes)
        predictions.append(Prediction(label, float(coefficients @ machine.parameters), steps(label, machine),
                                      float(inter_bytes)))
    return predictions
