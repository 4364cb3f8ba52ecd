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
