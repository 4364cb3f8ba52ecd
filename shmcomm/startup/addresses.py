# SPDX-License-Identifier: Apache-2.0
"""Where other hosts may reach this one: its IPv4 addresses, by interface."""
import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_addresses(interfaces=None):
    """This host's IPv4 addresses (of the interfaces named in `interfaces` only, if given), without repeats, loopback
    last."""
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            if interfaces and name not in interfaces:
                continue
            try:
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            found.append(socket.inet_ntoa(raw[20:24]))
    finally:
        probe.close()
    return sorted(dict.fromkeys(found), key=lambda a: a.startswith("127."))


def source_address(address):
    """The address of this host that the kernel sends from to reach `address` (no packet leaves), or None without
    a route."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, 9))
        return probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()


def listen_address(other_hosts):
    """Where a server that only the ranks of `other_hosts` (each a list of its addresses) reach should listen:
    loopback when they are all on this machine (hosts of a test, or none); else the one address of this host that
    routes to them all; else, when they are reached from different addresses of this host, every interface
    ("0.0.0.0")."""
    mine = set(interface_addresses())
    sources = set()
    for addresses in other_hosts:
        if set(addresses) <= mine:
            sources.add("127.0.0.1")
            continue
        routed = [source_address(a) for a in addresses if a not in mine and not a.startswith("127.")]
        sources.add(next((s for s in routed if s is not None), None))
    if not sources:
        return "127.0.0.1"
    return sources.pop() if len(sources) == 1 and None not in sources else "0.0.0.0"
