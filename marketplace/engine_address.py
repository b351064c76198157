"""Where the platform may call a provider's engine: the URL the agent reports, resolved once and
checked, so that a provider cannot point the platform's load tests, health checks and proxy at
its own network (loopback, link-local, private addresses, a cloud's metadata service).

The address that was checked is the address the platform connects to (`connect_url`): a name
that resolves elsewhere later (DNS rebinding) changes nothing until it is checked again.
Operators allow a private network with RIGSHARE_ENGINE_NETWORKS (the demo and the tests run
their engines on loopback).
"""

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit


class EngineAddressRefused(Exception):
    """A sentence saying why, for the node's engine_error."""


@dataclass(frozen=True)
class Checked:
    connect_url: str  # the reported URL with its host replaced by the checked address
    address: str


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def check(url: str, *, allowed_networks: tuple[str, ...] = (), resolve=None) -> Checked:
    """The URL to call the engine at, or EngineAddressRefused. Every address the name resolves
    to must be public (or in an allowed network): a name with one private answer among public
    ones is refused, since the platform cannot tell which one a later lookup would give."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EngineAddressRefused("the engine URL must be http:// or https:// with a host")
    if parts.username or parts.password:
        raise EngineAddressRefused("the engine URL must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise EngineAddressRefused("the engine URL's port is not a number") from None
    try:
        addresses = (resolve or _resolve)(parts.hostname, port)
    except (OSError, UnicodeError) as exc:
        raise EngineAddressRefused(f"the engine's host {parts.hostname} does not resolve "
                                   f"({exc})") from None
    if not addresses:
        raise EngineAddressRefused(f"the engine's host {parts.hostname} does not resolve")
    networks = [ipaddress.ip_network(n, strict=False) for n in allowed_networks]
    for text in addresses:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            ip = ip.ipv4_mapped
        for seen in (ip, *_embedded_ipv4(ip)):
            if not seen.is_global and not any(seen in net for net in networks if
                                               net.version == seen.version):
                within = "" if seen is ip else f" (within {ip})"
                raise EngineAddressRefused(
                    f"the engine's address {seen}{within} is {_kind(seen)}: Rigshare calls "
                    "engines only at public addresses")
    chosen = addresses[0].split("%", 1)[0]
    host = f"[{chosen}]" if ":" in chosen else chosen
    netloc = f"{host}:{parts.port}" if parts.port else host
    return Checked(urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", "")), chosen)


# IPv6 forms that carry an IPv4 address in their last 32 bits and reach it through a
# translator on the path: NAT64's well-known and local-use prefixes, and the deprecated
# IPv4-compatible form (::a.b.c.d).
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(ip) -> list:
    """The IPv4 addresses an IPv6 address leads to (NAT64, IPv4-compatible, 6to4, Teredo):
    each must be public too, or a provider could name 64:ff9b::169.254.169.254 and reach the
    metadata service through the platform's own NAT64 gateway."""
    if ip.version != 6:
        return []
    found = []
    low32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if any(ip in net for net in _NAT64) or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
        found.append(low32)
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found.extend(ip.teredo)
    return found


def _kind(ip) -> str:
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local (a cloud's metadata service lives there)"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    if ip.is_private:
        return "private"
    return "not a public address"
