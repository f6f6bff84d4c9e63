"""Hostile identifiers and bodies at the HTTP edge: refused with 4xx, nothing changed.

Paths are sent as raw bytes (no client normalises `..` or percent-escapes), and
after each batch the node's state -- capacity, invocations, live tokens, lane
memory, ledger, journal -- is compared with the state before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.adversarial.fixtures import (
    Node,
    error_code,
    http_request,
    raw_request,
    sleep_request,
)
from tests.adversarial.shared_daemon import SharedDaemon, shared_daemon

# Every test here is refused at the edge or makes one invocation of its own: they share
# one daemon (a daemon per test cost a second each), on one worker.
pytestmark = [pytest.mark.hostile("api"), pytest.mark.xdist_group("api_inputs")]

HOSTILE_IDS = {
    "traversal": "../../etc/passwd",
    "encoded_traversal": "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "double_encoded": "%252e%252e%252f",
    "dot": ".",
    "dotdot": "..",
    "leading_dash": "-rf",
    "nul": "a\x00b",
    "newline": "a\nb",
    "crlf_injection": "a\r\nX-Injected: 1",
    "tab": "a\tb",
    "del": "a\x7fb",
    "cyrillic_a": "inv-\u0430",
    "fullwidth_digits": "\uff11\uff12\uff13",
    "zero_width_space": "inv\u200b1",
    "rtl_override": "inv\u202e1",
    "combining": "inve\u0301",
    "emoji": "inv-\U0001f600",
    "long_129": "a" * 129,
    "long_10k": "a" * 10 * 1024,
    "empty": "",
    "space": "a b",
    "slash": "a/b",
    "backslash": "a\\b",
    "semicolon": "a;b",
    "query": "a?b=c",
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDaemon]:
    """One daemon for the module; each test's `daemon.node()` hands it back as it found it."""
    with shared_daemon(tmp_path_factory.mktemp("api-inputs")) as shared:
        yield shared


async def _nothing_changed(node: Node, before: Any) -> None:
    assert await node.state() == before


# Each case below is one request against the module's daemon; the state is compared
# after every request, the case named.


async def test_api_hostile_invocation_id_in_body_refused_422(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        before = await node.state()
        for ident, value in sorted(HOSTILE_IDS.items()):
            reply = await node.client.post(
                "/v1/invocations", json=sleep_request(value), headers=node.op
            )
            assert reply.status_code == 422, (ident, reply.text)
            assert error_code(reply) == "invalid_request", ident
            assert await node.state() == before, ident


_PATH_IDS = {
    "traversal": "../../etc/passwd",
    "encoded_traversal": "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "encoded_slash": "a%2fb",
    "encoded_nul": "a%00b",
    "encoded_newline": "a%0ab",
    "encoded_cyrillic": "inv-%D0%B0",
    "encoded_fullwidth": "%EF%BC%91%EF%BC%92",
    "raw_utf8_cyrillic": "inv-\u0430",
    "long_10k": "a" * 10 * 1024,
    "dotdot": "..",
    "backslash": "a%5cb",
    "overlong_utf8_dot": "%c0%ae%c0%ae%c0%af",
}


async def test_api_hostile_invocation_id_in_path_never_found_never_5xx(
    daemon: SharedDaemon,
) -> None:
    async with daemon.node() as node:
        await node.submit(sleep_request("victim"))
        before = await node.state()
        seen: dict[str, int] = {}
        for name, ident in _PATH_IDS.items():
            for method in ("GET", "DELETE"):
                raw = http_request(
                    method,
                    "/v1/invocations/" + ident,
                    headers={"Authorization": f"Bearer {node.scheduler}"},
                )
                reply = await raw_request(node.url, raw)
                seen[f"{method} {name}"] = reply.status
                assert reply.status in (400, 404), (name, method, reply.status, reply.body)
                if not reply.body:  # refused by the HTTP parser (raw UTF-8), before the app
                    assert reply.status == 400
                    continue
                assert reply.json()["error"]["code"] in {
                    "invalid_identifier",
                    "not_found",
                    "unknown_invocation",
                    "bad_request",
                }
        assert await node.state() == before
        assert (await node.client.get("/v1/invocations/victim", headers=node.op)).is_success
        assert len(seen) == 2 * len(_PATH_IDS)


async def test_api_hostile_lane_id_in_path_never_reaches_a_lane(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(sleep_request("lane-path-holder"))
        lane, token = next(iter(accepted["tokens"].items()))
        hostile = [
            "..%2F" + lane,
            lane + "%00",
            lane.upper(),
            lane.replace("lane_", "lane\uff3f"),  # fullwidth low line
            lane[:-1] + "\u0430",  # Cyrillic a for the last hex digit
            lane + "0",
            "lane_" + "0" * 10 * 1024,
        ]
        before = await node.state()
        for target in hostile:
            for action in ("work", "drain", "resume"):
                raw = http_request(
                    "POST",
                    f"/v1/lanes/{target}/{action}",
                    headers={
                        "Authorization": f"Bearer {token if action == 'work' else node.admin}"
                    },
                    body=b'{"op":"execute","kernel":"noop"}' if action == "work" else b"",
                )
                reply = await raw_request(node.url, raw)
                assert reply.status in (400, 404), (target, action, reply.status, reply.body)
        assert await node.state() == before
        snapshot = await node.snapshot()
        assert not any(lane_["drained"] for lane_ in snapshot["lanes"])


MALFORMED = [
    b"{",
    b"",
    b"[]",
    b"null",
    b'"string"',
    b"1",
    b'{"id":"x"',
    b'{"id":"x",}',
    b"{'id':'x'}",
    b'{"id":"x"} trailing',
    b'\xef\xbb\xbf{"id":"x"}',
    b'{"id":"\xff\xfe"}',
    b'{"id":NaN}',
    b'{"id":Infinity}',
    b"\x00" * 16,
    b'{"id":"x","work":' * 200,
]


async def test_api_malformed_json_refused_400_or_422(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        before = await node.state()
        for body in MALFORMED:
            reply = await node.client.post(
                "/v1/invocations",
                content=body,
                headers={**node.op, "Content-Type": "application/json"},
            )
            assert reply.status_code in (400, 422), (body[:40], reply.text)
            assert error_code(reply) in ("malformed_json", "invalid_request"), body[:40]
            assert await node.state() == before, body[:40]


def _with(path: str, value: Any) -> dict[str, Any]:
    body = sleep_request("typed")
    target = body
    *parents, leaf = path.split(".")
    for key in parents:
        target = target[key]
    target[leaf] = value
    return body


WRONG = {
    "id_number": ("id", 123),
    "id_null": ("id", None),
    "id_list": ("id", ["a"]),
    "work_list": ("work", [1]),
    "work_kind_unknown": ("work.kind", "shell"),
    "cpu_string": ("resources.cpu_millis", "100"),
    "cpu_float": ("resources.cpu_millis", 100.5),
    "cpu_bool": ("resources.cpu_millis", True),
    "cpu_negative": ("resources.cpu_millis", -1),
    "cpu_2_64": ("resources.cpu_millis", 2**64),
    "memory_negative": ("resources.memory_bytes", -1),
    "memory_2_64": ("resources.memory_bytes", 2**64),
    "memory_2_53_plus_1": ("resources.memory_bytes", 2**53 + 1),
    "memory_10_400": ("resources.memory_bytes", 10**400),
    "vram_negative": ("resources.vram_bytes", -1),
    "gpus_negative": ("resources.gpus", -1),
    "gpus_65": ("resources.gpus", 65),
    "timeout_zero": ("timeout_s", 0),
    "timeout_negative": ("timeout_s", -1),
    "timeout_string": ("timeout_s", "60"),
    "timeout_huge": ("timeout_s", 1e300),
    "requirement_unknown": ("requirement", "quantum"),
    "isolation_unknown": ("isolation", "none"),
    "isolation_case": ("isolation", "SHARED"),
    "unknown_field": ("owner", "root"),
    "unknown_resource": ("resources.disk_bytes", 1),
    "sleep_negative": ("work.args", {"seconds": -1}),
    "sleep_nan_string": ("work.args", {"seconds": "nan"}),
    "builtin_unknown": ("work.name", "rm"),
    "builtin_traversal": ("work.name", "../sleep"),
}


async def test_api_wrong_types_and_huge_numbers_refused(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        before = await node.state()
        for case, (path, value) in sorted(WRONG.items()):
            reply = await node.client.post(
                "/v1/invocations", json=_with(path, value), headers=node.op
            )
            assert reply.status_code in (400, 422), (case, reply.text)
            assert await node.state() == before, case


async def test_api_float_edge_literals_in_timeout_refused_or_sane(
    daemon: SharedDaemon,
) -> None:
    async with daemon.node() as node:
        before = await node.state()
        for literal in ["1e309", "-1e309", "1e400", "-0.0", "1.0e-400", "NaN"]:
            body = (
                b'{"id":"f","work":{"kind":"builtin","name":"sleep","args":{"seconds":60}},'
                b'"resources":{"cpu_millis":10,"memory_bytes":1048576},"timeout_s":'
                + literal.encode()
                + b"}"
            )
            reply = await node.client.post(
                "/v1/invocations",
                content=body,
                headers={**node.op, "Content-Type": "application/json"},
            )
            assert reply.status_code in (400, 422), (literal, reply.text)
            assert await node.state() == before, literal


async def test_api_lane_work_hostile_sizes_refused(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(
            sleep_request(
                "gpu",
                requirement="gpu",
                resources={"cpu_millis": 10, "memory_bytes": 2**20, "gpus": 1, "vram_bytes": 2**30},
            )
        )
        lane, token = next(iter(accepted["tokens"].items()))
        before = await node.state()
        for literal in ["18446744073709551616", "1e309", "-1", "0", "1.5", "true", '"1"', "1e3"]:
            reply = await node.client.post(
                f"/v1/lanes/{lane}/work",
                content=b'{"op":"memory_reserve","dtype":"uint8","shape":['
                + literal.encode()
                + b"]}",
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            assert reply.status_code in (400, 422), (literal, reply.text)
            assert await node.state() == before, literal


async def test_api_duplicate_keys_give_one_consistent_invocation(daemon: SharedDaemon) -> None:
    """Whatever the decoder keeps, the id answered, listed and reserved is one and the same."""
    body = (
        b'{"id":"first","id":"second",'
        b'"work":{"kind":"builtin","name":"sleep","args":{"seconds":60}},'
        b'"resources":{"cpu_millis":10,"memory_bytes":1048576,"cpu_millis":30}}'
    )
    async with daemon.node() as node:
        base = await node.capacity()
        # The shared daemon lists earlier tests' invocations (ended): only new ones count.
        listed, reserved_before = await node.invocation_ids(), node.ledger_reservations()
        assert node.journal_reservations() == reserved_before
        reply = await node.client.post(
            "/v1/invocations", content=body, headers={**node.op, "Content-Type": "application/json"}
        )
        if reply.status_code in (400, 422):
            assert await node.capacity() == base
            return
        assert reply.status_code == 202, reply.text
        kept = reply.json()["id"]
        assert kept in ("first", "second")
        other = "first" if kept == "second" else "second"
        assert await node.invocation_ids() == listed | {kept}
        missing = await node.client.get(f"/v1/invocations/{other}", headers=node.op)
        assert missing.status_code == 404
        assert node.ledger_reservations() == node.journal_reservations() == reserved_before | {kept}
        reserved = (await node.capacity())["cpu_millis"]["allocated"] - base["cpu_millis"][
            "allocated"
        ]
        assert reserved in (10, 30)
        # A replay of the same bytes is the same invocation; nothing more is reserved.
        again = await node.client.post(
            "/v1/invocations", content=body, headers={**node.op, "Content-Type": "application/json"}
        )
        assert again.status_code == 202 and again.json()["id"] == kept
        assert (await node.capacity())["cpu_millis"]["allocated"] == base["cpu_millis"][
            "allocated"
        ] + reserved


async def test_api_duplicate_work_keys_keep_one_kind(daemon: SharedDaemon) -> None:
    body = (
        b'{"id":"dup-work",'
        b'"work":{"kind":"process","argv":["/bin/false"]},'
        b'"work":{"kind":"builtin","name":"sleep","args":{"seconds":60}},'
        b'"resources":{"cpu_millis":10,"memory_bytes":1048576}}'
    )
    async with daemon.node() as node:
        reply = await node.client.post(
            "/v1/invocations", content=body, headers={**node.op, "Content-Type": "application/json"}
        )
        assert reply.status_code in (202, 400, 422), reply.text
        if reply.status_code == 202:
            status = await node.client.get("/v1/invocations/dup-work", headers=node.op)
            assert status.json()["state"] in ("queued", "running")  # the sleep, not /bin/false


@pytest.mark.parametrize(
    ("content_type", "status"),
    [("text/plain", 415), ("application/x-www-form-urlencoded", 415), (None, 415)],
)
async def test_api_non_json_content_type_refused(
    daemon: SharedDaemon, content_type: str | None, status: int
) -> None:
    async with daemon.node() as node:
        before = await node.state()
        raw = http_request(
            "POST",
            "/v1/invocations",
            headers={"Authorization": f"Bearer {node.scheduler}"},
            body=b'{"id":"ct","work":{"kind":"builtin","name":"sleep"}}',
            content_type=content_type,
        )
        reply = await raw_request(node.url, raw)
        assert reply.status == status, reply.body
        await _nothing_changed(node, before)


@pytest.mark.parametrize(
    "header",
    [
        "Bearer",
        "Bearer ",
        "bearer {s}",
        "Bearer {s}x",
        "Bearer {p}",
        "Basic {s}",
        "Bearer  {s}\x00",
        "Bearer {s}, Bearer {s}",
        "Bearer \u0430{r}",
    ],
    ids=["bare", "empty", "lowercase", "suffix", "prefix", "basic", "nul", "two", "cyrillic"],
)
async def test_api_operator_credential_variants_refused_401(
    daemon: SharedDaemon, header: str
) -> None:
    async with daemon.node() as node:
        before = await node.state()
        value = header.format(s=node.scheduler, p=node.scheduler[:-1], r=node.scheduler[1:])
        raw = http_request(
            "POST",
            "/v1/invocations",
            headers={"Authorization": value},
            body=b'{"id":"anon","work":{"kind":"builtin","name":"sleep"}}',
        )
        reply = await raw_request(node.url, raw)
        assert reply.status in (400, 401), (value, reply.status, reply.body)
        await _nothing_changed(node, before)


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [1000, 20000])
async def test_api_deeply_nested_json_in_submission_refused_4xx(
    daemon: SharedDaemon, depth: int
) -> None:
    body = (
        b'{"id":"deep","work":{"kind":"builtin","name":"sleep","args":{"x":' + _deep(depth) + b"}}}"
    )
    async with daemon.node() as node:
        before = await node.state()
        reply = await node.client.post(
            "/v1/invocations", content=body, headers={**node.op, "Content-Type": "application/json"}
        )
        await _nothing_changed(node, before)
        assert reply.status_code in (400, 413, 422), reply.text


async def test_api_deeply_nested_json_in_lane_work_refused_4xx(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(sleep_request("deep-work-holder"))
        lane, token = next(iter(accepted["tokens"].items()))
        before = await node.state()
        reply = await node.client.post(
            f"/v1/lanes/{lane}/work",
            content=b'{"op":"execute","kernel":"noop","args":{"x":' + _deep(5000) + b"}}",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        await _nothing_changed(node, before)
        assert reply.status_code in (400, 413, 422), reply.text


FRAMING = {
    "two_content_lengths": "Content-Length: {n}\r\nContent-Length: 5\r\n",
    "negative_content_length": "Content-Length: -1\r\n",
    "plus_content_length": "Content-Length: +{n}\r\n",
    "space_before_colon": "Content-Length : {n}\r\n",
    "te_identity": "Transfer-Encoding: identity\r\n",
    "te_gzip_chunked": "Transfer-Encoding: gzip, chunked\r\n",
}


@pytest.mark.parametrize("shape", sorted(FRAMING))
async def test_api_ambiguous_framing_refused_by_the_parser(
    daemon: SharedDaemon, shape: str
) -> None:
    """Request-smuggling shapes never reach a handler: 400, or 501 for a transfer coding
    the server does not implement (RFC 9112 section 6.1), and nothing is admitted."""
    body = b'{"id":"smuggled","work":{"kind":"builtin","name":"sleep"}}'
    async with daemon.node() as node:
        before = await node.state()
        head = (
            "POST /v1/invocations HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Authorization: Bearer {node.scheduler}\r\nContent-Type: application/json\r\n"
            + FRAMING[shape].format(n=len(body))
            + "\r\n"
        )
        reply = await raw_request(node.url, head.encode() + body)
        assert reply.status in (400, 501), (reply.status, reply.body)
        await _nothing_changed(node, before)
