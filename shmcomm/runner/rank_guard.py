# SPDX-License-Identifier: Apache-2.0
"""The script shmcommrun -H runs each rank's command under (mpi_launch.py passes it to hydra as `python -c`)."""

# Runs each rank's command under hydra (as `python -c RANK_GUARD GRACE STOPPED_LIMIT FIRST_RANKS command...`, with this
# launcher's Python, so the hosts need it at the same path, as they need the same environment anyway). It does two
# things hydra does not: it prefixes every output line with the rank, as on one host (hydra's -prepend-pattern marks
# every chunk it reads, even mid-line), forwarding an unfinished line (a progress bar) as its own frame that the
# launcher joins to the rest, and it turns a rank's failure into one hydra acts on. Hydra stops the job when a process
# dies by a signal (SIGKILL to every other rank at once, stopped ones included), but waits for all the others when one
# merely exits non-zero; so the guard reports the failure and then kills itself. It waits GRACE seconds first
# (--kill-grace-seconds, as one host's launcher waits between SIGTERM and SIGKILL): the other ranks are failing too, and
# their errors, which name the rank that failed or held the job up, are what a user needs to read. It also says when its
# rank has been stopped for two seconds, which only this host can see, and kills a rank stopped for 2 s more than
# STOPPED_LIMIT (SHMCOMM_TIMEOUT, the bound of every wait on a rank), as failed: the others may have ended and wait for
# it in MPI_Finalize, where nothing times out. (The 2 s: ranks that wait on it time out and call the roll first, and so
# find it stopped, not gone: rollcall.py.)
RANK_GUARD = r"""
import fcntl, os, select, signal, socket, stat, struct, subprocess, sys, termios, threading, time
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
lock = threading.Lock()
unfinished = set()  # the fds whose last frame was an unfinished line
busy = set()  # the fds whose pump holds text it read and has not passed on yet
def put(fd, data, unfinished_after=False, own_line=False):
    with lock:
        if own_line and fd in unfinished:  # the guard's own line: the rank's unfinished one ends first
            data = ("[%s]<stderr>: \n" % rank).encode() + data
        while data:
            data = data[os.write(fd, data):]
        (unfinished.add if unfinished_after else unfinished.discard)(fd)
def say(text):
    put(2, ("[%s]<stderr>: %s\n" % (rank, text)).encode(), own_line=True)
def pump(pipe, fd, label):
    # Frames, one per line of at most 64 KiB of text: "[r]<label>: text" is text and a newline; "[r]<label>+: text" is
    # text that does not end its line yet (a progress bar), held at most 0.1 s for its end. The launcher puts the
    # rank's text back together.
    whole, part = ("[%s]<%s>: " % (rank, label)).encode(), ("[%s]<%s>+: " % (rank, label)).encode()
    def frames(text, ends):
        pieces = [text[at:at + 65536] for at in range(0, len(text), 65536)] or [b""]
        return b"".join(part + piece + b"\n" for piece in pieces[:-1]) + (whole if ends else part) + pieces[-1] + b"\n"
    src, held, deadline = pipe.fileno(), b"", 0.0
    while True:
        if held and (len(held) >= 65536 or
                     not select.select([src], [], [], max(0.0, deadline - time.monotonic()))[0]):
            put(fd, frames(held, False), True)
            held = b""
            busy.discard(fd)
            continue
        if not held:
            select.select([src], [], [])
        busy.add(fd)  # before the read: once the rank sees its pipe empty, a flush request sees this pump busy
        data = os.read(src, 1 << 16)
        if not data:
            break
        if not held:
            deadline = time.monotonic() + 0.1
        held += data
        cut = held.rfind(b"\n") + 1
        if cut:
            put(fd, b"".join(frames(line, True) for line in held[:cut - 1].split(b"\n")))
            held = held[cut:]
            deadline = time.monotonic() + 0.1
        if not held:
            busy.discard(fd)
    busy.discard(fd)
    if held or fd in unfinished:
        put(fd, frames(held, True))  # the rank's last line ends here
def unread(fd):
    # What is still in the pipe on fd, which hydra's proxy reads: what it has not read when it is killed is lost.
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        pass
    return 0
def pass_causes(sock):
    # The rank's cause line (startup/failure_reports.py), sent on at once as a frame the launcher keeps for its last
    # line and its notices, as the launcher's host may not see the rank's saved report. An empty line asks whether
    # everything the rank wrote has been passed on: answered once the pumps hold nothing and hydra's proxy has read
    # it all, since MPI_Abort, which the rank calls next, has hydra kill this guard and the proxy at once. The proxy
    # forwards what it reads before it reads the rank's abort, so the launcher gets it first.
    with sock, sock.makefile("rb") as lines:
        for line in lines:
            if line.strip():
                put(2, ("[%s]<cause>: " % rank).encode() + line.rstrip(b"\n")[:4096] + b"\n")
                continue
            deadline = time.monotonic() + 1.5
            while (busy or unread(1) or unread(2)) and time.monotonic() < deadline:
                time.sleep(0.001)
            sock.sendall(b"\n")
cause_here, cause_rank = socket.socketpair()
cause_rank.set_inheritable(True)
os.environ["SHMCOMM_GUARD_SOCKET"] = "%d:%d" % (cause_rank.fileno(), os.fstat(cause_rank.fileno()).st_ino)
try:
    # close_fds=False: the rank needs hydra's PMI_FD and the cause socket; the guard's other descriptors are not
    # inheritable.
    child = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=False)
except OSError as error:
    say("cannot run %r: %s" % (sys.argv[1], error.strerror or error))
    code = 127
else:
    cause_rank.close()
    threading.Thread(target=pass_causes, args=(cause_here,), daemon=True).start()
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
                with open("/proc/%d/stat" % child.pid) as proc_stat:
                    state = proc_stat.read().rpartition(") ")[2][:1]
            except OSError:
                state = ""
            stopped = stopped + 1 if state in ("T", "t") else 0
            if stopped == 2:
                say("shmcommrun: rank %s (pid %d) on %s is stopped (SIGSTOP, or a debugger)"
                    % (rank, child.pid, socket.gethostname()))
            if stopped >= stopped_limit + 2:
                how = "stayed stopped for %d s (SHMCOMM_TIMEOUT is %g s) and was killed" % (stopped, stopped_limit)
                child.kill()
    for thread in pumps:
        thread.join(3)
if code != 0:
    how = how or ("was killed by signal %d" % -code if code < 0 else "exited with code %d" % code)
    say("shmcommrun: rank %s on %s %s; stopping the job in %g s" % (rank, socket.gethostname(), how, grace))
    time.sleep(grace)
    os.kill(os.getpid(), signal.SIGKILL)
"""
