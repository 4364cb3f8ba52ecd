# SPDX-License-Identifier: Apache-2.0
"""The script shmcommrun -H runs each rank's command under (mpi_launch.py passes it to hydra as `python -c`)."""

# Runs each rank's command under hydra (as `python -c RANK_GUARD GRACE STOPPED_LIMIT FIRST_RANKS command...`, with this launcher's Python,
# so the hosts need it at the same path, as they need the same environment anyway). It does two things hydra does
# not: it prefixes every output line with the rank, as on one host (hydra's -prepend-pattern marks every chunk
# it reads, even mid-line), and it turns a rank's failure into one hydra acts on. Hydra stops the job when a
# process dies by a signal (SIGKILL to every other rank at once, stopped ones included), but waits for all the
# others when one merely exits non-zero; so the guard reports the failure and then kills itself. It waits GRACE
# seconds first (--kill-grace-seconds, as one host's launcher waits between SIGTERM and SIGKILL): the other ranks
# are failing too, and their errors, which name the rank that failed or held the job up, are what a user needs
# to read. It also says when its rank has been stopped for two seconds, which only this host can see, and kills a
# rank stopped for 2 s more than STOPPED_LIMIT (SHMCOMM_TIMEOUT, the bound of every wait on a rank), as failed: the
# others may have ended and wait for it in MPI_Finalize, where nothing times out. (The 2 s: ranks that wait on it
# time out and call the roll first, and so find it stopped, not gone: rollcall.py.)
RANK_GUARD = r"""
import os, signal, socket, subprocess, sys, threading, time
rank = os.environ.get("PMI_RANK", "?")
grace = float(sys.argv.pop(1))
stopped_limit = float(sys.argv.pop(1))
first_ranks = [int(r) for r in sys.argv.pop(1).split(",")]  # each host's first rank: hydra fills hosts in order
if rank.isdigit():  # torchrun's names too, so that a torch.distributed script runs unchanged
    os.environ.update(RANK=rank, WORLD_SIZE=os.environ.get("PMI_SIZE", ""),
                      LOCAL_RANK=os.environ.get("MPI_LOCALRANKID", ""),
                      LOCAL_WORLD_SIZE=os.environ.get("MPI_LOCALNRANKS", ""),
                      GROUP_RANK=str(sum(1 for first in first_ranks if first <= int(rank)) - 1))
how = None
def put(fd, data):
    while data:
        data = data[os.write(fd, data):]
def pump(pipe, fd, label):
    prefix = ("[%s]<%s>: " % (rank, label)).encode()
    for line in iter(lambda: pipe.readline(1 << 20), b""):
        put(fd, prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
try:
    # close_fds=False: the rank needs hydra's PMI_FD; the guard's own descriptors are not inheritable anyway.
    child = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=False)
except OSError as error:
    put(2, ("[%s]<stderr>: cannot run %r: %s\n" % (rank, sys.argv[1], error.strerror or error)).encode())
    code = 127
else:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: child.send_signal(signum))
    pumps = [threading.Thread(target=pump, args=(pipe, fd, label), daemon=True)
             for pipe, fd, label in ((child.stdout, 1, "stdout"), (child.stderr, 2, "stderr"))]
    for thread in pumps:
        thread.start()
    stopped = 0  # seconds the rank has been seen stopped: said once, since no rank can tell which one it is
    while True:
        try:
            code = child.wait(1.0)
            break
        except subprocess.TimeoutExpired:
            try:
                with open("/proc/%d/stat" % child.pid) as stat:
                    state = stat.read().rpartition(") ")[2][:1]
            except OSError:
                state = ""
            stopped = stopped + 1 if state in ("T", "t") else 0
            if stopped == 2:
                put(2, ("[%s]<stderr>: shmcommrun: rank %s (pid %d) on %s is stopped (SIGSTOP, or a debugger)\n"
                        % (rank, rank, child.pid, socket.gethostname())).encode())
            if stopped >= stopped_limit + 2:
                how = "stayed stopped for %d s (SHMCOMM_TIMEOUT is %g s) and was killed" % (stopped, stopped_limit)
                child.kill()
    for thread in pumps:
        thread.join(3)
if code != 0:
    how = how or ("was killed by signal %d" % -code if code < 0 else "exited with code %d" % code)
    put(2, ("[%s]<stderr>: shmcommrun: rank %s on %s %s; stopping the job in %g s\n"
            % (rank, rank, socket.gethostname(), how, grace)).encode())
    time.sleep(grace)
    os.kill(os.getpid(), signal.SIGKILL)
"""
