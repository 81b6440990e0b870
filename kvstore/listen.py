"""Where the Transfer Engine listens, and keeping it to the interface the user asked for.

Mooncake's Transfer Engine (0.3.x) binds its handshake RPC port and its tcp data port to every
interface (``INADDR_ANY`` / ``in6addr_any`` in ``findAvailableTcpPort`` and the tcp transport's
acceptor); ``MC_TCP_BIND_ADDRESS`` only changes the address it *advertises*. Those ports let a
peer read and write registered cache memory without a token. After the engine started,
:func:`restrict_listeners` finds the listening sockets it opened (this process's sockets in
``/proc/net/tcp{,6}`` that did not listen before) and sets ``SO_BINDTODEVICE`` on them to the
interface that owns the engine's hostname (``lo`` for 127.0.0.1 / ::1): the kernel then accepts
connections only from that interface (``ss -ltn`` shows ``0.0.0.0%lo:PORT``). Where that is
not possible (another host name, no permission) it returns the ports left open so the caller
can warn, naming them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915
_LISTEN = "0A"


def listening_sockets() -> dict[int, tuple[int, int]]:
    """This process's listening TCP sockets: ``{inode: (fd, port)}`` (Linux ``/proc``)."""
    ports: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == _LISTEN:
                        ports[int(cols[9])] = int(cols[1].rsplit(":", 1)[1], 16)
        except OSError:
            continue
    out: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inode = int(link[8:-1])
            if inode in ports:
                out[inode] = (int(name), ports[inode])
    return out


def interface_of(host: str) -> str | None:
    """The network interface that owns ``host`` (an IP or a name): ``lo`` for loopback
    addresses, ``None`` for the unspecified address (every interface) or when no interface of
    this machine has it."""
    h = host
    if h.startswith("["):  # [v6]:port
        h = h[1:].split("]")[0]
    elif h.count(":") == 1:  # v4 or name with a port
        h = h.split(":")[0]
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(h))
        except (OSError, ValueError):
            return None
    if ip.is_unspecified:
        return None
    if ip.is_loopback:
        return "lo"
    for _, name in socket.if_nameindex():
        if ip.version == 4 and _ipv4_of(name) == ip:
            return name
        if ip.version == 6 and ip in _ipv6_of(name):
            return name
    return None


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return ipaddress.IPv4Address(raw[20:24])


def _ipv6_of(name: str) -> list[ipaddress.IPv6Address]:
    try:
        with open("/proc/net/if_inet6") as f:
            return [ipaddress.IPv6Address(int(c[0], 16)) for c in map(str.split, f)
                    if c[5] == name]
    except OSError:
        return []


def restrict_listeners(before: dict[int, tuple[int, int]], host: str) -> tuple[str | None,
                                                                              list[int]]:
    """Bind every socket that listens now and did not in ``before`` (see
    :func:`listening_sockets`) to ``host``'s interface.

    Returns:
        ``(interface, ports still open on every interface)``; the interface is ``None`` when
        ``host`` names none of this machine's (then every new port is in the list).
    """
    new = {i: v for i, v in listening_sockets().items() if i not in before}
    iface = interface_of(host)
    if iface is None:
        return None, sorted(p for _, p in new.values())
    left: list[int] = []
    for fd, port in new.values():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            left.append(port)
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, iface.encode())
        except OSError:
            left.append(port)
        finally:
            s.close()
    return iface, sorted(left)


def bound_device(fd: int) -> str:
    """The ``SO_BINDTODEVICE`` interface of socket ``fd`` (``""``: every interface)."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        return s.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 16).rstrip(b"\0").decode()
    finally:
        s.close()


__all__ = ["bound_device", "interface_of", "listening_sockets", "restrict_listeners"]
