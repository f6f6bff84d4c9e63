"""Which local uid owns the other end of a TCP connection, from the kernel.

On the Unix socket SO_PEERCRED names the caller's uid; TCP has no such option,
but the kernel's socket diagnostics do: a NETLINK_SOCK_DIAG `inet_diag_req_v2`
for one exact 4-tuple (the peer's address and port as its source, ours as its
destination) answers with the peer socket's `idiag_uid`, the uid that made it.
A peer that is not a socket of this host's network namespace (another machine,
a container's own namespace) is not found: its uid is unknown.

The lookup is made once per connection, when it is accepted and before any of
its bytes are read, as SO_PEERCRED is taken at connect: a peer that closes or
hands its socket on later changes nothing. It is bounded (one request, one
reply of at most 8 KiB, LOOKUP_SECONDS) and fails closed: anything unexpected
is None, "unknown", never a uid. Sockets with no owner left are unknown too: a
TIME_WAIT or request socket reports uid 0 and an orphaned one no inode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import logging
import socket
import struct

import trio

__all__ = [
    "LOOKUP_SECONDS",
    "TcpEnds",
    "diag_request",
    "ends_of",
    "parse_diag_reply",
    "tcp_peer_uid",
]

log = logging.getLogger(__name__)

LOOKUP_SECONDS = 0.5
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
TCP_LISTEN = 10
_NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: match by the 4-tuple alone
_ALL_STATES = 0xFFFFFFFF
_REPLY_BYTES = 8192

_NLMSG = struct.Struct("=IHHII")  # struct nlmsghdr: len, type, flags, seq, pid
_REQ = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, ext, pad, states
_PORTS = struct.Struct(">HH")  # inet_diag_sockid: sport, dport (network order)
_TAIL = struct.Struct("=III")  # inet_diag_sockid: if, cookie[2]
_MSG_HEAD = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retrans
_MSG_TAIL = struct.Struct("=IIIII")  # inet_diag_msg: expires, rqueue, wqueue, uid, inode
_SOCKID_BYTES = _PORTS.size + 32 + _TAIL.size
_MSG_BYTES = _MSG_HEAD.size + _SOCKID_BYTES + _MSG_TAIL.size
_ERRNO = struct.Struct("=i")
_seq = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class TcpEnds:
    """One connection as its peer's socket holds it: the peer's end is that socket's
    source, ours its destination. Addresses are 16 bytes (IPv4 in the first 4)."""

    family: int
    peer: bytes
    peer_port: int
    ours: bytes
    our_port: int


def _packed(host: str) -> tuple[int, bytes] | None:
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        # A dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d; the kernel holds them as IPv4.
        address = address.ipv4_mapped
    if isinstance(address, ipaddress.IPv4Address):
        return socket.AF_INET, address.packed + bytes(12)
    return socket.AF_INET6, address.packed


def ends_of(peer: object, ours: object) -> TcpEnds | None:
    """The ends of an accepted IP socket from getpeername() and getsockname(); None for
    anything that is not an (address, port, ...) pair of one family."""
    if not isinstance(peer, tuple) or not isinstance(ours, tuple):
        return None
    if len(peer) < 2 or len(ours) < 2:
        return None
    (peer_host, peer_port), (our_host, our_port) = peer[:2], ours[:2]
    if not all(isinstance(v, str) for v in (peer_host, our_host)):
        return None
    if not all(isinstance(v, int) and 0 < v < 65536 for v in (peer_port, our_port)):
        return None
    left, right = _packed(peer_host), _packed(our_host)
    if left is None or right is None or left[0] != right[0]:
        return None
    return TcpEnds(left[0], left[1], peer_port, right[1], our_port)


def diag_request(ends: TcpEnds, seq: int) -> bytes:
    """The netlink message asking for the one TCP socket whose source is the peer's end
    and whose destination is ours (not a dump: NLM_F_REQUEST alone)."""
    sockid = (
        _PORTS.pack(ends.peer_port, ends.our_port)
        + ends.peer
        + ends.ours
        + _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
    )
    body = _REQ.pack(ends.family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES) + sockid
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_diag_reply(data: bytes, ends: TcpEnds, seq: int) -> int | None:
    """The uid owning the peer's socket, from the kernel's reply to `diag_request`;
    None for an error (ENOENT: no such socket here), a reply to something else, a
    listener, a socket no process holds any more, or bytes that do not parse."""
    if len(data) < _NLMSG.size:
        return None
    length, kind, _flags, got_seq, _pid = _NLMSG.unpack_from(data)
    if got_seq != seq or not _NLMSG.size <= length <= len(data):
        return None
    if kind == NLMSG_ERROR:
        if length >= _NLMSG.size + _ERRNO.size:
            log.debug("sock_diag: errno %d", -_ERRNO.unpack_from(data, _NLMSG.size)[0])
        return None
    if kind != SOCK_DIAG_BY_FAMILY or length < _NLMSG.size + _MSG_BYTES:
        return None
    at = _NLMSG.size
    family, state, _timer, _retrans = _MSG_HEAD.unpack_from(data, at)
    at += _MSG_HEAD.size
    sport, dport = _PORTS.unpack_from(data, at)
    at += _PORTS.size
    src, dst = data[at : at + 16], data[at + 16 : at + 32]
    at += _SOCKID_BYTES - _PORTS.size
    *_queues, uid, inode = _MSG_TAIL.unpack_from(data, at)
    width = 4 if family == socket.AF_INET else 16
    found = (family, sport, dport, src[:width], dst[:width])
    wanted = (ends.family, ends.peer_port, ends.our_port, ends.peer[:width], ends.ours[:width])
    if found != wanted or state == TCP_LISTEN:
        return None
    if inode == 0:
        # TIME_WAIT and request sockets say uid 0, an orphan keeps its maker's: no owner now.
        return None
    return int(uid)


async def tcp_peer_uid(
    sock: trio.socket.SocketType, *, seconds: float = LOOKUP_SECONDS
) -> int | None:
    """The uid owning the local socket at the other end of the accepted `sock`, or None
    (a peer not on this host, a kernel without sock_diag, no answer in `seconds`)."""
    try:
        ends = ends_of(sock.getpeername(), sock.getsockname())
    except OSError:
        return None
    if ends is None:
        return None
    seq = next(_seq) & 0xFFFFFFFF
    try:
        diag = trio.socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except OSError as exc:
        log.debug("sock_diag unavailable: %s", exc)
        return None
    with diag, contextlib.suppress(OSError), trio.move_on_after(seconds):
        await diag.send(diag_request(ends, seq))
        # The kernel answers within the send; a reply that is not ours is not waited past.
        return parse_diag_reply(await diag.recv(_REPLY_BYTES), ends, seq)
    return None
