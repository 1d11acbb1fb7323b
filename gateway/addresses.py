"""Host addresses as the gateway configures and advertises them: one definition of each rule.

- `is_unspecified(host)`: the "any" address in every spelling (`0.0.0.0`, `::`, `0:0:0:0:0:0:0:0`,
  `::0`, `[::]` ...) or no address at all (""). As a bind address it means every interface; in an SDP
  c= line it is the RFC 2543 way to put a stream on hold (RFC 3264 §8.4). Neither is an address
  anybody can send to, so it is never advertised.
- `advertised_address(*candidates)`: the first candidate that is a concrete address. Callers list
  what the operator configured, in order of preference, then the local address toward the peer.
- `local_ip_toward(ip)`: our address on the route to `ip` (asks the kernel; nothing is sent).
"""

from __future__ import annotations

import ipaddress
import socket


def is_unspecified(host: str) -> bool:
    """True for "" and for an unspecified IPv4/IPv6 address however it is written."""
    text = host
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text:
        return True
    try:
        return ipaddress.ip_address(text).is_unspecified
    except ValueError:
        return False  # a host name (never resolved here) or garbage: not the wildcard


def advertised_address(*candidates: str | None) -> str:
    """The first candidate that is a concrete address (not empty, not a wildcard).

    Raises ValueError when there is none: an SDP or Contact with 0.0.0.0 would tell the peer to hold
    the call or send nowhere."""
    for candidate in candidates:
        if candidate and not is_unspecified(candidate):
            return candidate
    raise ValueError("no concrete address to advertise (every candidate is empty or a wildcard)")


def local_ip_toward(ip: str) -> str:
    """Our address on the route to `ip`: a connected UDP socket sends nothing, the kernel picks."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
