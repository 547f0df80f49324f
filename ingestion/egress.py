"""Where a source's requests may go: name resolution and the address policy.

Every request a source causes connects only to an address that this module allowed, and
to exactly that address: :func:`resolve` runs once per connection, every address it
returns is judged, and the connection is made to one of them by IP (``ingestion.http``
keeps the host name for SNI, certificate checks and the ``Host`` header). A DNS answer
that changes between a check and the connection (rebinding) therefore cannot send a
worker anywhere the check did not see.

Without ``allow_private`` a source reaches public addresses only. With it (``add_source
--allow-private``, for an operator's own host) loopback, private, shared and link-local
addresses are allowed too, but only for the source's own host (:func:`own_host`): the
host name of its URL, on its port or 80/443. A listing, feed entry or redirect that
names any other host is judged as public-only, so an internal site's feed, whose
entries anyone may write, cannot point workers at the rest of the network. Cloud
metadata, "this network" (``0.0.0.0/8``), multicast and reserved addresses are never
allowed.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: RFC 1122 "this host on this network": never a destination (Linux connects 0.0.0.0 to
#: the local host, and newer kernels route the rest of 0/8).
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")

#: Instance metadata and credential services, refused even to sources allowed private
#: addresses: AWS, GCP, Azure, OpenStack (169.254.169.254, AWS's IPv6 fd00:ec2::254),
#: Alibaba Cloud (100.100.100.200), and the container credential endpoints that hand out
#: cloud keys (ECS task credentials 169.254.170.2, EKS Pod Identity 169.254.170.23 and
#: fd00:ec2::23).
METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",
        "fd00:ec2::254",
        "100.100.100.200",
        "169.254.170.2",
        "169.254.170.23",
        "fd00:ec2::23",
    )
)


class ResolutionError(OSError):
    """The host name does not resolve (or is not a valid name)."""


def resolve(host: str, port: int) -> list[IPAddress]:
    """The addresses ``host`` resolves to, in the resolver's order (TCP, any family).

    This is the one resolver of the pull side; tests replace it to make a name resolve
    to an address of their choosing, with no change to the machine's resolver.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
        raise ResolutionError(f"cannot resolve {host}: {exc}") from exc
    seen: dict[IPAddress, None] = {}
    for info in infos:
        seen[ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])] = None
    if not seen:
        raise ResolutionError(f"cannot resolve {host}: no address")
    return list(seen)


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo, NAT64), if any."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in ipaddress.ip_network("64:ff9b::/96"):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public(address: IPAddress) -> bool:
    """Whether ``address`` is on the public internet: not private, loopback, link-local,
    multicast, reserved, unspecified or otherwise special-purpose. An IPv6 address that
    carries an IPv4 one (``::ffff:10.0.0.1``, 6to4, Teredo, NAT64) is judged by both."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return is_public(address.ipv4_mapped)
    inner = embedded_ipv4(address)
    if inner is not None and not is_public(inner):
        return False
    return address.is_global and not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        # fec0::/10, deprecated but still routed on some networks: Python counts it global.
        or (isinstance(address, ipaddress.IPv6Address) and address.is_site_local)
    )


def never_allowed(address: IPAddress) -> bool:
    """Addresses no source may reach, whatever its flag: metadata, unspecified, multicast,
    reserved (judged on the IPv4 address an IPv6 one carries, too)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return never_allowed(address.ipv4_mapped)
    inner = embedded_ipv4(address)
    if inner is not None and never_allowed(inner):
        return True
    return (
        address in METADATA
        or (isinstance(address, ipaddress.IPv4Address) and address in THIS_NETWORK)
        or address.is_unspecified
        or address.is_multicast
        or (address.is_reserved and not address.is_loopback)
    )


def address_allowed(address: IPAddress, allow_private: bool) -> bool:
    """Whether a request of a source with this flag may connect to ``address``."""
    if never_allowed(address):
        return False
    return allow_private or is_public(address)


def _normal_host(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


def own_host(source_url: str, host: str, port: int) -> bool:
    """Whether ``host:port`` is the host of ``source_url`` (same name, compared without
    case or a final dot; on the URL's port, or 80 or 443 for a change of scheme)."""
    parts = urlsplit(source_url)
    try:
        own_port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    return (
        bool(parts.hostname)
        and _normal_host(host) == _normal_host(parts.hostname or "")
        and (port in (own_port, 80, 443))
    )


def private_allowed(allow_private: bool, source_url: str, host: str, port: int) -> bool:
    """Whether a request to ``host:port`` may reach internal addresses: only with the
    source's flag, and only on the source's own host (:func:`own_host`)."""
    return allow_private and own_host(source_url, host, port)


def refused(addresses: list[IPAddress], allow_private: bool) -> IPAddress | None:
    """The first address of ``addresses`` the policy refuses, or None when all are allowed.

    One refused address refuses the host: a name that resolves to a public and a private
    address is someone's trick, not a site to read.
    """
    for address in addresses:
        if not address_allowed(address, allow_private):
            return address
    return None
