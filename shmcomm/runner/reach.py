# SPDX-License-Identifier: Apache-2.0
"""Whether the hosts of a multi-host job answer, checked before mpiexec starts."""
import subprocess
import time

_REACH_TIMEOUT_S = 10  # per host, all at once: ssh's own ConnectTimeout, and the check's bound


def unreachable_host(hosts, agent=None, ssh_port=None, ssh_identity_file=None):
    """(host, why) for the first of `hosts` that ssh (or the launcher agent, as hydra will run it) cannot run `true`
    on within _REACH_TIMEOUT_S, or None: checked before mpiexec starts, as horovodrun does, so that the error names the
    host instead of showing hydra's internals."""
    base = [agent] if agent else ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={_REACH_TIMEOUT_S}"]
    base += ["-p", str(int(ssh_port))] if ssh_port is not None else []
    base += ["-i", ssh_identity_file] if ssh_identity_file else []
    checks = []
    for host in hosts:
        try:
            checks.append((host, subprocess.Popen(base + [host, "true"], stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        except OSError as error:
            return host, f"cannot run {base[0]!r}: {error.strerror or error}"
    found = None
    deadline = time.monotonic() + _REACH_TIMEOUT_S + 1
    for host, check in checks:
        try:
            _, err = check.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            check.kill()
            check.communicate()
            found = found or (host, f"no answer within {_REACH_TIMEOUT_S} s")
            continue
        if check.returncode != 0 and found is None:
            lines = err.decode("utf-8", errors="replace").strip().splitlines()
            found = host, (lines[-1] if lines else f"{base[0]} exited with code {check.returncode}")
    return found
