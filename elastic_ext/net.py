"""Free TCP ports (for each round's workers' store, and for the local job tooling), and
the address and interface of a node's workers' network."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Mapping


def free_ports(count: int, host: str = "") -> list[int]:
    """``count`` distinct ports that are free on ``host`` now (``""``: every interface).

    The sockets stay open until all are bound, so the ports differ from each other; a
    port is only free when this returns, so whoever binds it later can still lose a race.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "") -> int:
    """One port that is free on ``host`` now (``""``: every interface)."""
    return free_ports(1, host)[0]


IFNAME_VARS = ("ELASTIC_EXT_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
"""Where a job names the interface of its workers' network, the first set wins:
etcd-ext's own, then NCCL's, then gloo's (their values are interface names separated by
commas; NCCL reads a name as a prefix unless it starts with ``=``, and ``^`` excludes)."""

_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, str]:
    """Each up interface's IPv4 address (Linux; {} where it cannot be read)."""
    found: dict[str, str] = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address, or not up
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def chosen_interface(env: Mapping[str, str] | None = None,
                     addresses: Mapping[str, str] | None = None) -> tuple[str, str, str] | None:
    """(variable, interface, its address) the job's environment names for its workers'
    network (``IFNAME_VARS``), the first that names an interface with an IPv4 address here;
    None when none does."""
    env = os.environ if env is None else env
    addresses = interface_addresses() if addresses is None else addresses
    for var in IFNAME_VARS:
        for wanted in filter(None, (part.strip() for part in env.get(var, "").split(","))):
            if wanted.startswith("^"):
                continue  # an exclusion names no interface to use
            exact = wanted.startswith("=") or var != "NCCL_SOCKET_IFNAME"
            wanted = wanted.lstrip("=")
            for name in sorted(addresses):
                if name == wanted or (not exact and name.startswith(wanted)):
                    return var, name, addresses[name]
    return None


def workers_address(local_addr: str | None, env: Mapping[str, str] | None = None) -> str:
    """The address a node publishes for its workers (their store, the others' probes):
    ``--local-addr`` when given, else the address of the interface ``IFNAME_VARS`` name,
    else the host's name."""
    if local_addr:
        return local_addr
    chosen = chosen_interface(env)
    return chosen[2] if chosen is not None else socket.getfqdn()


def describe_interface(addr: str, env: Mapping[str, str] | None = None,
                       addresses: Mapping[str, str] | None = None) -> str:
    """Which interface ``addr`` is on here, and what chose it, for messages that must
    say where a node's workers talk: ``eth1 (GLOO_SOCKET_IFNAME=eth1)``."""
    env = os.environ if env is None else env
    addresses = interface_addresses() if addresses is None else addresses
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(addr, None, socket.AF_INET)}
    except OSError:
        resolved = {addr}
    on = sorted(name for name, ip in addresses.items() if ip in resolved)
    named = ", ".join(f"{var}={env[var]}" for var in IFNAME_VARS if env.get(var))
    where = f"interface {on[0]}" if on else "no interface of this host holds it"
    return f"{where} ({named or 'none of ' + ', '.join(IFNAME_VARS) + ' set'})"
