"""Buffer upload and download over real HTTP, with the daemon's real lane hosts."""

from __future__ import annotations

import pathlib

import httpx
import numpy as np
import trio

from supervisor.lane_work import MAX_TRANSFER_BYTES
from tests.api_fixtures import bearer, builtin_request, running_daemon
from tests.integration.test_api_lanes import error_code, gpu_request, submit

N = 32768
OCTETS = {"Content-Type": "application/octet-stream"}


async def test_upload_execute_download_and_their_bounds(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=30) as client,
    ):
        lane, token = next(iter((await submit(client, node, gpu_request("b1")))["tokens"].items()))
        _, other = next(iter((await submit(client, node, gpu_request("b2")))["tokens"].items()))
        auth = bearer(token)

        async def reserve(shape: list[int]) -> str:
            reply = await client.post(
                f"/v1/lanes/{lane}/work",
                json={"op": "memory_reserve", "dtype": "float32", "shape": shape},
                headers=auth,
            )
            assert reply.status_code == 200, reply.text
            assert set(reply.json()) >= {"buffer_id", "bytes_held"}
            return str(reply.json()["buffer_id"])

        # Bigger than any JSON body may be (64 KiB): uploads have their own bound.
        x, y = await reserve([N]), await reserve([N])
        values = np.arange(N, dtype=np.float32)
        url = f"/v1/lanes/{lane}/buffers/{x}"
        put = await client.put(url, content=values.tobytes(), headers={**auth, **OCTETS})
        assert put.status_code == 200, put.text
        run = await client.post(
            f"/v1/lanes/{lane}/work",
            json={
                "op": "execute",
                "kernel": "axpy",
                "args": {"alpha": 2.0},
                "buffers": {"x": x, "y": y},
            },
            headers=auth,
        )
        assert run.status_code == 200, run.text
        got = await client.get(f"/v1/lanes/{lane}/buffers/{y}?length={4 * N}", headers=auth)
        assert got.status_code == 200 and got.headers["content-type"] == "application/octet-stream"
        np.testing.assert_array_equal(np.frombuffer(got.content, np.float32), 2 * values)

        # Bounds: past the buffer, past the transfer limit, the wrong media type.
        past = await client.put(
            url + f"?offset={4 * N - 4}", content=b"12345678", headers={**auth, **OCTETS}
        )
        assert (past.status_code, error_code(past)) == (416, "out_of_range")
        huge = await client.get(f"{url}?length={MAX_TRANSFER_BYTES + 1}", headers=auth)
        assert huge.status_code == 400
        json_body = await client.put(url, json=[1, 2], headers=auth)
        assert json_body.status_code == 415
        # A declared length over the limit is refused before a byte of it is read.
        host, port = node.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        head = (
            f"PUT {url} HTTP/1.1\r\nHost: node\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/octet-stream\r\n"
            f"Content-Length: {MAX_TRANSFER_BYTES + 1}\r\n\r\n"
        )
        async with stream:
            await stream.send_all(head.encode())
            with trio.fail_after(10):
                answer = await stream.receive_some(4096)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
        # Another invocation's token cannot read or write it; a missing token is 401.
        for reply in (
            await client.get(f"{url}?length=4", headers=bearer(other)),
            await client.put(url, content=b"0000", headers={**bearer(other), **OCTETS}),
        ):
            assert (reply.status_code, error_code(reply)) == (404, "buffer_not_found")
        assert (await client.get(f"{url}?length=4")).status_code == 401
        # Nothing refused changed the buffer.
        again = await client.get(f"{url}?length={4 * N}", headers=auth)
        np.testing.assert_array_equal(np.frombuffer(again.content, np.float32), values)


async def test_an_integer_past_64_bits_is_bad_args_and_the_co_tenant_keeps_its_buffer(
    tmp_path: pathlib.Path,
) -> None:
    """The report: any lane token, even the CPU pool's execute-only one, sent an arg
    of 2**70; framing it for the host raised, the caller got 503 `lane_owner_crashed`,
    the buffer holders on the lane were cancelled and six of these faulted the lane."""
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=30) as client,
    ):
        lane, holder = next(iter((await submit(client, node, gpu_request("b1")))["tokens"].items()))
        hostile_lane, hostile = next(
            iter((await submit(client, node, gpu_request("b2")))["tokens"].items())
        )
        assert hostile_lane == lane  # shared work packs onto one GPU
        cpu_lane, cpu = next(
            iter(
                (await submit(client, node, builtin_request("b3", args={"seconds": 60})))[
                    "tokens"
                ].items()
            )
        )
        reserve = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "memory_reserve", "dtype": "uint8", "shape": [16]},
            headers=bearer(holder),
        )
        assert reserve.status_code == 200, reserve.text
        buf = reserve.json()["buffer_id"]
        url = f"/v1/lanes/{lane}/buffers/{buf}"
        put = await client.put(url, content=bytes(range(16)), headers={**bearer(holder), **OCTETS})
        assert put.status_code == 200, put.text
        sup = node.daemon.supervisor
        assert sup is not None
        starts = {name: sup.owners[name].host_starts for name in (lane, cpu_lane)}
        body = b'{"op":"execute","kernel":"noop","args":{"x":1180591620717411303424}}'
        for target, token in [(lane, hostile)] * 6 + [(cpu_lane, cpu)] * 6:
            reply = await client.post(
                f"/v1/lanes/{target}/work",
                content=body,
                headers={**bearer(token), "Content-Type": "application/json"},
            )
            assert (reply.status_code, error_code(reply)) == (422, "bad_args"), reply.text
        assert {name: sup.owners[name].host_starts for name in starts} == starts
        assert not any(sup.owners[name].faulted for name in starts)
        for invocation in ("b1", "b2", "b3"):
            got = await client.get(f"/v1/invocations/{invocation}", headers=bearer(node.scheduler))
            assert got.json()["state"] == "running", got.text
        kept = await client.get(f"{url}?length=16", headers=bearer(holder))
        assert kept.status_code == 200 and kept.content == bytes(range(16))
        noop = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "execute", "kernel": "noop"},
            headers=bearer(hostile),
        )
        assert noop.status_code == 200, noop.text
