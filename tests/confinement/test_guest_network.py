"""Every class gets a network namespace of its own (loopback only): no guest reaches
the host's loopback services or another guest's abstract Unix socket. A request may
ask for the host's network only where the operator allows it (`--guest-host-network`),
and the status says which network a guest got."""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket
import uuid
from collections.abc import Iterator

import trio

from tests.adversarial.fixtures import Node, error_code
from tests.confinement.guests import confined_node, python, run_to_end, status

LISTEN_ABSTRACT = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.bind('\\0' + sys.argv[1])\n"
    "s.listen()\n"
    "print('LISTENING', flush=True)\n"
    "time.sleep(60)\n"
)
# argv: another guest's abstract name, the host's abstract name, the host's TCP port.
PROBE = (
    "import json, socket, sys\n"
    "def reach(family, address):\n"
    "    s = socket.socket(family)\n"
    "    s.settimeout(2)\n"
    "    try:\n"
    "        s.connect(address)\n"
    "        return 'connected'\n"
    "    except OSError as exc:\n"
    "        return f'refused {exc.errno}'\n"
    "print(json.dumps({\n"
    "    'guest_abstract': reach(socket.AF_UNIX, '\\0' + sys.argv[1]),\n"
    "    'host_abstract': reach(socket.AF_UNIX, '\\0' + sys.argv[2]),\n"
    "    'host_loopback': reach(socket.AF_INET, ('127.0.0.1', int(sys.argv[3]))),\n"
    "    'interfaces': sorted(n for _, n in socket.if_nameindex()),\n"
    "}))\n"
)


@contextlib.contextmanager
def host_listeners() -> Iterator[tuple[str, int]]:
    """A TCP server on the host's 127.0.0.1 and an abstract Unix socket in the host's
    network namespace: (the abstract name, the port)."""
    name = f"litegraph-test-host-{uuid.uuid4().hex[:12]}"
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        unix.bind("\0" + name)
        unix.listen()
        yield name, tcp.getsockname()[1]


def _request(code: str, isolation: str, *args: str, **fields: object) -> dict[str, object]:
    body = python(code, isolation=isolation, **fields)
    if isolation == "dedicated":
        body["requirement"] = "gpu"
        body["resources"] = {"cpu_millis": 500, "memory_bytes": 256 * 2**20, "gpus": 1}
    body["work"]["argv"] += list(args)
    return body


async def _listening(node: Node, invocation_id: str) -> None:
    with trio.fail_after(30):
        while "LISTENING" not in (found := await status(node, invocation_id))["stdout_tail"]:
            assert found["state"] == "running", found
            await trio.sleep(0.05)


async def test_no_class_reaches_the_hosts_loopback_or_another_guests_abstract_socket(
    tmp_path: pathlib.Path,
) -> None:
    """The report: `shared`, `dedicated` and `partitioned` guests used the host's network
    namespace and reached each other's abstract Unix sockets and loopback services."""
    async with confined_node(tmp_path) as node:
        with host_listeners() as (host_name, port):
            for isolation in ("shared", "dedicated"):
                name = f"litegraph-test-guest-{uuid.uuid4().hex[:12]}"
                listener = _request(LISTEN_ABSTRACT, "shared", name, invocation_id=f"l-{isolation}")
                await node.submit(listener)
                await _listening(node, f"l-{isolation}")
                probe = _request(PROBE, isolation, name, host_name, str(port))
                ended = await run_to_end(node, probe)
                assert ended["state"] == "succeeded", ended
                seen = json.loads(ended["stdout_tail"])
                for place in ("guest_abstract", "host_abstract", "host_loopback"):
                    assert seen[place].startswith("refused"), (isolation, place, seen)
                assert seen["interfaces"] == ["lo"], (isolation, seen)
                assert ended["network"] == "none"
                assert (await status(node, f"l-{isolation}"))["network"] == "none"
                await node.client.delete(f"/v1/invocations/l-{isolation}", headers=node.op)


async def test_host_network_is_refused_unless_the_operator_allows_it(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        before = await node.state()
        body = python("print('ran')", invocation_id="wants-host", network="host")
        reply = await node.client.post("/v1/invocations", json=body, headers=node.op)
        assert reply.status_code == 422, reply.text
        assert error_code(reply) == "host_network_not_allowed"
        assert "--guest-host-network" in reply.json()["error"]["message"]
        assert await node.state() == before
        missing = await node.client.get("/v1/invocations/wants-host", headers=node.op)
        assert missing.status_code == 404


async def test_with_the_operators_flag_a_guest_asking_for_it_gets_the_host_network(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path, "--guest-host-network") as node:
        with host_listeners() as (host_name, port):
            body = _request(PROBE, "shared", "nobody", host_name, str(port), network="host")
            ended = await run_to_end(node, body)
            assert ended["state"] == "succeeded", ended
            assert ended["network"] == "host"
            seen = json.loads(ended["stdout_tail"])
            assert seen["host_loopback"] == "connected", seen
            assert seen["host_abstract"] == "connected", seen
            # Allowed is not the default: a guest that does not ask keeps its own.
            default = await run_to_end(node, _request(PROBE, "shared", "x", host_name, str(port)))
            assert default["network"] == "none"
            assert json.loads(default["stdout_tail"])["host_loopback"].startswith("refused")
