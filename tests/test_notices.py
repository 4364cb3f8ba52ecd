# SPDX-License-Identifier: Apache-2.0
"""The multi-host launcher's failure notices on their own (runner/notice_server.py to startup/notices.py): a rank
hears every notice, those sent before it connected included, at the first of the launcher's addresses that answers;
the first failure and the first stop are kept apart; a rank's cause of failure reaches the others' errors.
tests/test_multihost.py shows them naming a rank killed before
MPI had started, across simulated hosts."""
import os
import socket
import time

from shmcomm.startup import failure_reports
from shmcomm.runner.notice_server import NoticeServer
from shmcomm.startup.notices import LauncherNotices


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


SECRET = bytes(range(32))  # the job's


def _closed_port():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: a connection is refused
    return "127.0.0.1:%d" % port


def test_a_rank_hears_every_notice_at_the_first_address_that_answers():
    server = NoticeServer(SECRET)
    try:
        server.publish(2, "hostb", "is stopped (SIGSTOP, or a debugger)", stopped=True)
        heard = []
        notices = LauncherNotices(",".join([_closed_port()] + server.addresses), lambda *cause: heard.append(cause),
                                  SECRET)
        try:
            assert _until(lambda: notices.stopped is not None)
            assert notices.stopped == (2, "rank 2 on hostb is stopped (SIGSTOP, or a debugger)")
            assert notices.failed is None and notices.listening
            server.publish(3, "hosta", "was killed by signal 9")
            server.publish(1, "hosta", "exited with code 1")
            assert _until(lambda: notices.failed is not None)
            assert _until(lambda: len(server.connections) == 1)
            time.sleep(0.1)
            assert notices.failed == (3, "rank 3 on hosta was killed by signal 9")  # the first one stays
            server.publish_cause(1, "ValueError: bad batch")
            assert _until(lambda: heard) and heard == [(1, "ValueError: bad batch")]
            assert notices.failed[0] == 3  # a cause is not a failure notice of its own
        finally:
            notices.close()
        assert _until(lambda: not server.connections)  # the server forgets a rank that hung up
    finally:
        server.close()


def test_without_a_launcher_nothing_is_heard():
    notices = LauncherNotices(None, on_cause=print, secret=SECRET)
    assert notices.failed is None and notices.stopped is None and not notices.listening
    notices.close()
    unreachable = LauncherNotices(_closed_port(), on_cause=print, secret=SECRET)
    time.sleep(0.2)
    assert unreachable.failed is None and not unreachable.listening
    unreachable.close()


def test_a_cause_heard_from_the_launcher_names_a_rank_whose_report_is_on_another_host(tmp_path, monkeypatch):
    monkeypatch.setattr(failure_reports, "_heard", {})
    monkeypatch.setenv("SHMCOMM_ERROR_REPORT_DIR", str(tmp_path / "on-the-launchers-host"))  # not on this one
    assert failure_reports.with_cause("rank 1 failed", 1) == "rank 1 failed"
    failure_reports.heard(1, "ValueError: bad batch")
    assert failure_reports.with_cause("rank 1 failed", 1) == "rank 1 failed (ValueError: bad batch)"
    monkeypatch.delenv("SHMCOMM_ERROR_REPORT_DIR")
    assert failure_reports.with_cause("rank 1 failed", 1) == "rank 1 failed (ValueError: bad batch)"
    (tmp_path / "rank1.cause").write_text("KeyError: 'x'\n")  # a report this host can read comes first
    monkeypatch.setenv("SHMCOMM_ERROR_REPORT_DIR", str(tmp_path))
    assert failure_reports.with_cause("rank 1 failed", 1) == "rank 1 failed (KeyError: 'x')"


def test_the_cause_goes_to_the_guards_pipe_and_never_to_another_file(tmp_path, monkeypatch):
    monkeypatch.delenv("SHMCOMM_ERROR_REPORT_DIR", raising=False)
    read_end, write_end = os.pipe()
    other = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT)
    try:
        monkeypatch.setenv("SHMCOMM_GUARD_SOCKET", "%d:%d" % (write_end, os.fstat(write_end).st_ino))
        failure_reports.save_uncaught(1, ValueError, ValueError("bad\nbatch"), None)
        assert os.read(read_end, 100) == b"ValueError: bad batch\n"
        # The same variable in a process where that number is another file (a rank's subprocess): nothing written.
        monkeypatch.setenv("SHMCOMM_GUARD_SOCKET", "%d:%d" % (other, os.fstat(write_end).st_ino))
        assert failure_reports.guard_socket() is None
        failure_reports.save_uncaught(1, ValueError, ValueError("bad batch"), None)
        assert (tmp_path / "other").read_bytes() == b""
    finally:
        for fd in (read_end, write_end, other):
            os.close(fd)
