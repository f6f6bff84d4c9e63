"""/docs: the API reference page, served from files shipped with the node, rendered
offline by headless Chromium under a policy that forbids every load from elsewhere.

Chromium is not installed by the test: without it the rendering test is skipped
on a workstation and fails under CI (the CI script installs `chromium`)."""

from __future__ import annotations

import html
import html.parser
import os
import pathlib
import re
import shutil

import httpx
import pytest
import trio

from api.openapi import DOCS_ASSETS, openapi_document
from tests.api_fixtures import running_daemon

CHROMIUM_SECONDS = 60
METHODS = {"get", "put", "post", "delete"}


def _chromium() -> str:
    found = "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    found = found or shutil.which("chromium")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required under CI (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    return found


class _Links(html.parser.HTMLParser):
    """Every URL the page itself names (src, href, and the like)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in {"src", "href", "action", "srcset"} and v]


def _directives(policy: str) -> dict[str, list[str]]:
    return {
        name: sources
        for name, *sources in (part.split() for part in policy.split(";") if part.strip())
    }


async def test_the_page_and_its_files_are_served_from_here_only(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        page = await client.get("/docs")  # no credential: it is public, as /openapi.json is
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        policy = _directives(page.headers["content-security-policy"])
        assert policy["default-src"] == ["'none'"]
        for name in ("script-src", "style-src", "connect-src", "font-src"):
            assert policy[name] == ["'self'"], name
        assert policy["img-src"] == ["'self'", "data:"]
        assert policy["frame-ancestors"] == policy["base-uri"] == ["'none'"]
        links = _Links()
        links.feed(page.text)
        assert links.urls, "the page names no file"
        for url in links.urls:
            assert url.startswith("/docs/") or url == "/openapi.json", url
        for url in {u for u in links.urls if u.startswith("/docs/")} | {"/docs/init.js"}:
            asset = await client.get(url)
            assert asset.status_code == 200, url
            assert asset.headers["content-type"] == DOCS_ASSETS[url.removeprefix("/docs/")]
            assert asset.headers["x-content-type-options"] == "nosniff"
        init = (await client.get("/docs/init.js")).text
        assert re.findall(r'url: "([^"]*)"', init) == ["/openapi.json"]
        assert "supportedSubmitMethods: []" in init and "validatorUrl: null" in init
        for name in ("LICENSE", "NOTICE"):  # the renderer's licence ships with it
            assert (await client.get(f"/docs/{name}")).status_code == 200
        for wrong in (
            "/docs/index.css",
            "/docs/..%2Fstatic%2Findex.html",
            "/docs/..%2F..%2Fapp.py",
        ):
            missing = await client.get(wrong)
            assert missing.status_code == 404, wrong
            assert missing.headers["content-type"] == "application/json"


async def test_the_page_renders_every_operation_offline_without_a_policy_violation(
    tmp_path: pathlib.Path,
) -> None:
    browser = _chromium()
    summaries = [
        operation["summary"]
        for item in openapi_document()["paths"].values()
        for method, operation in item.items()
        if method in METHODS
    ]
    async with running_daemon(tmp_path) as node:
        argv = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            # Offline: anything not on loopback goes to a proxy that is not there.
            "--proxy-server=http://127.0.0.1:9",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--dump-dom",
            f"{node.url}/docs",
        ]
        with trio.fail_after(CHROMIUM_SECONDS):
            done = await trio.run_process(
                argv, capture_stdout=True, capture_stderr=True, check=False
            )
    log = done.stderr.decode(errors="replace")
    assert done.returncode == 0, log[-2000:]
    dom = done.stdout.decode()
    violations = [line for line in log.splitlines() if "Content Security Policy" in line]
    assert not violations, "\n".join(violations)
    # Swagger UI shows what it cannot read of the document in an error box.
    assert "errors-wrapper" not in dom, re.findall(r"errors-wrapper.{0,400}", dom)
    rendered = re.findall(r'class="opblock-summary-description"[^>]*>([^<]*)<', dom)
    assert sorted(html.unescape(s) for s in rendered) == sorted(summaries)
    tags = re.findall(r'data-tag="([^"]+)"', dom)
    assert set(tags) == {tag["name"] for tag in openapi_document()["tags"]}
