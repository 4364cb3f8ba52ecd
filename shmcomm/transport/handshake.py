# SPDX-License-Identifier: Apache-2.0
"""Every TCP connection of a job opens with proof, both ways, that its two ends hold the job's secret: the handshake
of csrc/net/handshake.c (HMAC-SHA256 over nonces both ends draw afresh), which the box server runs in C and the
launcher's servers, the ranks' clients and the elastic mesh run through here. A server admits a client before it
reads or sends anything else, so an outsider gets a random nonce back and changes nothing; a client proves itself
before its first word, and hears nothing from a server that cannot prove itself in turn."""
import logging

from shmcomm._native import ffi, lib
from shmcomm.vocabulary.exceptions import AuthenticationError, TimeoutError

log = logging.getLogger("shmcomm.security")
TIMEOUT_S = float(lib.SMC_HANDSHAKE_TIMEOUT_S)


def _why(outcome):
    return ffi.string(lib.smc_handshake_refusal(outcome)).decode()


def _peer(sock):
    try:
        return "%s:%d" % sock.getpeername()[:2]
    except (OSError, TypeError):  # gone, or not an IP socket
        return "a peer that is gone"


def prove(sock, secret, whom, timeout_s=TIMEOUT_S):
    """Proves to the server on `sock` that this process holds `secret` (bytes), and takes its proof in turn. Raises
    AuthenticationError naming `whom` (how the error calls the server) and closes `sock` when either proof fails:
    a server that hangs up after this process's proof holds another secret, or this process does; TimeoutError
    when the server does not answer within timeout_s (a process stopped, or one that is not a server of the job)."""
    outcome = lib.smc_handshake_prove(sock.fileno(), secret, len(secret), timeout_s)
    if outcome == lib.SMC_HANDSHAKE_PROVEN:
        return
    peer = _peer(sock)
    sock.close()
    if outcome == lib.SMC_HANDSHAKE_CLOSED:
        why = "it refused this process's proof: this process does not hold the job's secret (SHMCOMM_SECRET)"
    elif outcome == lib.SMC_HANDSHAKE_WRONG:
        why = "it did not prove it holds the job's secret: it is not a process of this job"
    else:
        why = _why(outcome)
    error = TimeoutError if outcome == lib.SMC_HANDSHAKE_TIMEOUT else AuthenticationError
    raise error("%s at %s: %s" % (whom, peer, why))


def admit(sock, secret, where, timeout_s=TIMEOUT_S):
    """Takes the proof of the client on `sock` that it holds `secret`, and proves the same to it. True when it did;
    otherwise closes `sock`, logs one warning naming the client's address and `where` (the server's name), and
    returns False."""
    outcome = lib.smc_handshake_admit(sock.fileno(), secret, len(secret), timeout_s)
    if outcome == lib.SMC_HANDSHAKE_PROVEN:
        return True
    log.warning("%s refused a connection from %s: %s", where, _peer(sock), _why(outcome))
    sock.close()
    return False
