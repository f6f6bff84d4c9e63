"""Who owns the other end of a TCP connection: the sock_diag message and its reply, as
bytes, and the lookup against this host's kernel (any user may ask)."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

import pytest
import trio

from api.tcp_peer import (
    NLMSG_ERROR,
    SOCK_DIAG_BY_FAMILY,
    TCP_LISTEN,
    TcpEnds,
    diag_request,
    ends_of,
    parse_diag_reply,
    tcp_peer_uid,
)

LOOPBACK = bytes([127, 0, 0, 1]) + bytes(12)
ENDS = TcpEnds(socket.AF_INET, LOOPBACK, 40000, LOOPBACK, 7380)
TCP_ESTABLISHED = 1


def reply(
    ends: TcpEnds = ENDS,
    *,
    seq: int = 9,
    state: int = TCP_ESTABLISHED,
    uid: int = 200001,
    inode: int = 4242,
    sport: int | None = None,
    attributes: bytes = b"",
) -> bytes:
    """An inet_diag_msg as the kernel writes it, in a netlink message."""
    sockid = (
        struct.pack(">HH", ends.peer_port if sport is None else sport, ends.our_port)
        + ends.peer
        + ends.ours
        + struct.pack("=III", 0, 1, 2)
    )
    body = struct.pack("=BBBB", ends.family, state, 0, 0) + sockid
    body += struct.pack("=IIIII", 0, 0, 0, uid, inode) + attributes
    return struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY, 2, seq, 0) + body


def test_the_request_names_the_peer_as_source_and_us_as_destination() -> None:
    data = diag_request(ENDS, 9)
    assert len(data) == 16 + 56 == struct.unpack_from("=I", data)[0]
    assert struct.unpack_from("=HHI", data, 4) == (SOCK_DIAG_BY_FAMILY, 1, 9)  # no dump
    family, protocol, _ext, _pad, _states = struct.unpack_from("=BBBBI", data, 16)
    assert (family, protocol) == (socket.AF_INET, socket.IPPROTO_TCP)
    assert struct.unpack_from(">HH", data, 24) == (40000, 7380)
    assert data[28:44] == LOOPBACK and data[44:60] == LOOPBACK
    assert struct.unpack_from("=III", data, 60) == (0, 0xFFFFFFFF, 0xFFFFFFFF)


def test_a_reply_for_exactly_that_connection_gives_its_uid() -> None:
    assert parse_diag_reply(reply(), ENDS, 9) == 200001
    assert parse_diag_reply(reply(attributes=b"\x08\x00\x01\x00abcd"), ENDS, 9) == 200001


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (reply(seq=8), "an answer to another request"),
        (reply(sport=40001), "another connection"),
        (reply(TcpEnds(socket.AF_INET6, LOOPBACK, 40000, LOOPBACK, 7380)), "another family"),
        (reply(state=TCP_LISTEN), "a listener"),
        (reply(inode=0), "a socket no process holds (TIME_WAIT says uid 0, an orphan)"),
        (reply(uid=0, inode=0), "a TIME_WAIT socket"),
        (reply()[:-1], "cut short"),
        (reply()[:20], "cut shorter"),
        (b"", "nothing"),
        (struct.pack("=IHHIIi", 20, NLMSG_ERROR, 0, 9, 0, -2), "ENOENT: not on this host"),
        (struct.pack("=IHHII", 16, 3, 0, 9, 0), "NLMSG_DONE alone"),
        (struct.pack("=IHHII", 999, SOCK_DIAG_BY_FAMILY, 0, 9, 0), "a length past the bytes"),
    ],
)
def test_anything_else_is_unknown_never_a_uid(data: bytes, why: str) -> None:
    assert parse_diag_reply(data, ENDS, 9) is None, why


def test_ends_come_from_socket_addresses_and_mapped_ipv4_is_ipv4() -> None:
    plain = ends_of(("127.0.0.1", 40000), ("127.0.0.1", 7380))
    assert plain == ENDS
    mapped = ends_of(("::ffff:127.0.0.1", 40000, 0, 0), ("::ffff:127.0.0.1", 7380, 0, 0))
    assert mapped == ENDS
    six = ends_of(("::1", 40000, 0, 0), ("::1", 7380, 0, 0))
    assert six is not None and six.family == socket.AF_INET6 and six.peer == bytes(15) + b"\x01"
    for peer, ours in [
        ("/run/node.sock", ""),  # a Unix socket
        (("127.0.0.1", 40000), ("::1", 7380, 0, 0)),  # two families
        (("localhost", 40000), ("127.0.0.1", 7380)),  # a name, not an address
        (("127.0.0.1", 0), ("127.0.0.1", 7380)),
        (("127.0.0.1",), ("127.0.0.1", 7380)),
    ]:
        assert ends_of(peer, ours) is None, (peer, ours)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def _accepted(listener: socket.socket, client: socket.socket) -> trio.socket.SocketType:
    client.connect(listener.getsockname())
    server, _ = listener.accept()
    return trio.socket.from_stdlib_socket(server)


async def test_the_kernel_names_the_uid_of_a_local_peer(listener: socket.socket) -> None:
    with socket.socket() as client, _accepted(listener, client) as server:
        assert await tcp_peer_uid(server) == os.geteuid()


async def test_a_dual_stack_listener_finds_an_ipv4_peer() -> None:
    if not socket.has_dualstack_ipv6():
        pytest.skip("no dual-stack IPv6 here")
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as six:
        with socket.create_connection(("127.0.0.1", six.getsockname()[1])) as _client:
            server, peer = six.accept()
            assert peer[0] == "::ffff:127.0.0.1"
            with trio.socket.from_stdlib_socket(server) as accepted:
                assert await tcp_peer_uid(accepted) == os.geteuid()


async def test_a_peer_that_closed_its_socket_is_unknown(listener: socket.socket) -> None:
    client = socket.socket()
    with _accepted(listener, client) as server:
        client.close()  # orphaned, then TIME_WAIT or FIN_WAIT2: no process holds it
        with trio.fail_after(5):
            while await server.recv(1):  # its FIN has arrived
                pass
        assert await tcp_peer_uid(server) is None


async def test_no_answer_in_time_is_unknown(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Silent:
        def __init__(self, *args: object) -> None:
            pass

        def __enter__(self) -> Silent:
            return self

        def __exit__(self, *args: object) -> None:
            pass

        async def send(self, data: bytes) -> int:
            return len(data)

        async def recv(self, size: int) -> bytes:
            await trio.sleep_forever()
            raise AssertionError

    monkeypatch.setattr(trio.socket, "socket", Silent)
    with socket.socket() as client:
        with _accepted(listener, client) as server:
            with trio.fail_after(2):
                assert await tcp_peer_uid(server, seconds=0.05) is None


async def test_a_kernel_without_sock_diag_is_unknown(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: object) -> None:
        raise OSError(97, "Address family not supported by protocol")

    monkeypatch.setattr(trio.socket, "socket", refused)
    with socket.socket() as client:
        with _accepted(listener, client) as server:
            assert await tcp_peer_uid(server) is None
