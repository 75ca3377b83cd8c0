"""Node addresses: IP literals for whatever binds (Ray, sglang-router), names for URLs.

sglang-router refuses hostnames (`--host` must be an IP literal) and Ray's
`--node-ip-address` must be an address of the node, so everything that binds or
advertises a bind address goes through `ip_literal`. URLs may keep hostnames.
"""

from __future__ import annotations

import ipaddress
import socket


def ip_literal(host: str) -> str:
    """`host` as an IP literal: unchanged if it already is one, else its first IPv4
    address (IPv6 if it has none). Raises ValueError if it does not resolve."""
    bare = host.strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as err:
        raise ValueError(f"cannot resolve host {host!r} to an IP address ({err}); "
                         "give the node's IP address instead") from err
    # Prefer IPv4: an IPv6 literal needs brackets in URLs and some tools mishandle it.
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def url_host(ip_or_name: str) -> str:
    """A host as it goes into a URL: IPv6 literals in brackets, anything else unchanged."""
    try:
        if ipaddress.ip_address(ip_or_name.strip("[]")).version == 6:
            return f"[{ip_or_name.strip('[]')}]"
    except ValueError:
        pass
    return ip_or_name
