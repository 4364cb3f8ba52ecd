# SPDX-License-Identifier: Apache-2.0
"""Runs a function on N ranks, each its own process, without a launcher.

Every rank gets the launcher's environment contract and a fresh job token, runs `fn(*args)`, and sends back its
result or its traceback. The harness bounds the whole run with a timeout, kills what is left, and checks that the job
left nothing in /dev/shm."""
import multiprocessing
import os
import secrets
import signal
import time
import traceback

from shmcomm.runner.cleanup import job_segment_pattern, remove_job_segments


class RankError(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def _rank_main(rank, size, token, extra_env, prefix, conn, fn, args):
    for name in [k for k in os.environ if k.startswith(("SHMCOMM_", "HOROVOD_"))]:
        del os.environ[name]  # only what this run gives
    identity = {"RANK": rank, "SIZE": size, "LOCAL_RANK": rank, "LOCAL_SIZE": size, "CROSS_RANK": 0, "CROSS_SIZE": 1,
                "JOB_TOKEN": token}
    os.environ.update({prefix + name: str(value) for name, value in identity.items()})
    os.environ.update(extra_env or {})
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # report everything, including SystemExit
        result = ("error", "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    try:
        import shmcomm

        shmcomm.shutdown()
    except Exception:
        pass
    conn.send(result)
    conn.close()
    os._exit(0)


def run(size, fn, *args, timeout=60, env=None, check=True, prefix="SHMCOMM_"):
    """Returns the list of per-rank results. With check=False, failures come back as ("error", text) pairs
    instead of raising; a rank that died without reporting gives ("died", exitcode). prefix="HOROVOD_" gives the
    ranks their identity under Horovod's names only."""
    ctx = multiprocessing.get_context("fork")
    token = secrets.token_hex(16)
    procs, conns = [], []
    for rank in range(size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(rank, size, token, env, prefix, child, fn, args), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)

    results = [None] * size
    deadline = time.monotonic() + timeout
    pending = set(range(size))
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            if conns[r].poll(0.01):
                try:
                    results[r] = conns[r].recv()
                except EOFError:
                    results[r] = ("died", procs[r].exitcode)
                pending.discard(r)
            elif not procs[r].is_alive() and not conns[r].poll(0):
                results[r] = ("died", procs[r].exitcode)
                pending.discard(r)
    for r in pending:
        results[r] = ("timeout", "rank %d still running after %.0f s" % (r, timeout))
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    leaked = remove_job_segments(token)
    if leaked:
        raise AssertionError("the job left shared-memory segments behind: %s" % leaked)
    if not check:
        return results
    failures = [(r, res) for r, res in enumerate(results) if res[0] != "ok"]
    if failures:
        raise RankError("\n".join("--- rank %d: %s\n%s" % (r, res[0], res[1]) for r, res in failures))
    return [res[1] for res in results]


def Event():
    """An event the ranks of one run share: pass it to run() among the args, so that a rank waits for another to have
    done something (event.wait(timeout)) instead of sleeping for a while."""
    return multiprocessing.get_context("fork").Event()


def job_segments_exist(token):
    pattern = job_segment_pattern(token)
    return [n for n in os.listdir("/dev/shm") if pattern.match(n)]
