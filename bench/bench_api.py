"""The HTTP API under load, and the daemon's cost when idle.

1. GET /v1/snapshot against GET /healthz of the same `serve --devices sim`
   subprocess, load from a second process: `wrk` when installed, else a
   Python keep-alive load generator (the figures say which). The snapshot is
   served from the encoded cache, so it should cost about what the probe
   costs: throughput ratio >= 0.9, and its p99 is reported beside the probe's.
2. Idle cost: CPU seconds and RSS of a `serve --devices sim` subprocess over
   30 s with nothing to do (psutil), held to under 1% of one core.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import psutil  # type: ignore[import-untyped,unused-ignore]

from bench.harness import Finding

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOAD_SECONDS = 5
CONNECTIONS = 16
IDLE_SECONDS = 30
THROUGHPUT_TARGET = 0.9
IDLE_CPU_TARGET = 0.01  # fraction of one core

# A keep-alive load generator for machines without wrk: threads on http.client.
PY_LOAD = r"""
import http.client, json, sys, threading, time
host, port, path, secret, seconds, conns = sys.argv[1:7]
seconds, conns = float(seconds), int(conns)
headers = {"Authorization": "Bearer " + secret} if secret else {}
lat, lock = [], threading.Lock()
def worker():
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    mine, end = [], time.perf_counter() + seconds
    while (t := time.perf_counter()) < end:
        c.request("GET", path, headers=headers); r = c.getresponse(); r.read()
        assert r.status == 200, r.status
        mine.append(time.perf_counter() - t)
    with lock: lat.extend(mine)
ts = [threading.Thread(target=worker) for _ in range(conns)]
start = time.perf_counter(); [t.start() for t in ts]; [t.join() for t in ts]
lat.sort()
print(json.dumps({"rps": len(lat) / (time.perf_counter() - start),
                  "p99_ms": 1000 * lat[max(0, int(len(lat) * 0.99) - 1)]}))
"""


@contextlib.contextmanager
def serve(state_dir: pathlib.Path, *extra: str) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    """`litegraph-node serve --devices sim` on loopback; yields (process, url, secret)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LITEGRAPH_NODE_")}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-m", "node", "serve", "--devices", "sim", "--listen", "127.0.0.1:0"]
    argv += ["--state-dir", str(state_dir), "--log-level", "warning", *extra]
    # --log-level warning hides "listening on": ask /readyz via the port in the pid's sockets.
    with subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
    ) as proc:
        try:
            url = _wait_for_url(proc)
            secret = json.loads((state_dir / "auth.json").read_text())["scheduler"]
            yield proc, url, secret
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait_for_url(proc: subprocess.Popen[str]) -> str:
    import httpx

    deadline = time.monotonic() + 30
    process = psutil.Process(proc.pid)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}")
        listening = [c for c in process.net_connections("tcp") if c.status == "LISTEN"]
        if listening:
            url = f"http://127.0.0.1:{listening[0].laddr.port}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    return url
        time.sleep(0.1)
    raise RuntimeError("the daemon did not become ready in 30 s")


def _wrk(url: str, path: str, secret: str) -> tuple[float, float]:
    argv = ["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{LOAD_SECONDS}s", "--latency"]
    if secret:
        argv += ["-H", f"Authorization: Bearer {secret}"]
    out = subprocess.run(
        [*argv, url + path], capture_output=True, text=True, timeout=LOAD_SECONDS + 60, check=True
    ).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors on {path}:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    value, unit = re.search(r"99%\s+([\d.]+)(us|ms|s)", out).groups()  # type: ignore[union-attr]
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    return rps, float(value) * scale


def _python_load(url: str, path: str, secret: str) -> tuple[float, float]:
    host, port = url.removeprefix("http://").split(":")
    argv = [sys.executable, "-c", PY_LOAD, host, port, path, secret, str(LOAD_SECONDS)]
    argv.append(str(CONNECTIONS))
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=LOAD_SECONDS + 60, check=True
    ).stdout
    figures = json.loads(out)
    return float(figures["rps"]), float(figures["p99_ms"])


def throughput() -> Finding:
    load = _wrk if shutil.which("wrk") else _python_load
    tool = "wrk" if load is _wrk else "python http.client threads"
    with tempfile.TemporaryDirectory() as tmp, serve(pathlib.Path(tmp)) as (_, url, secret):
        load(url, "/healthz", "")  # warm up both paths once, untimed
        load(url, "/v1/snapshot", secret)
        probe_rps, probe_p99 = load(url, "/healthz", "")
        snap_rps, snap_p99 = load(url, "/v1/snapshot", secret)
    ratio = snap_rps / probe_rps
    return Finding(
        name="GET /v1/snapshot vs GET /healthz (same server)",
        target=f">= {THROUGHPUT_TARGET}x the probe's throughput",
        figures={
            "load": f"{tool}, {CONNECTIONS} connections, {LOAD_SECONDS} s each",
            "snapshot": f"{snap_rps:,.0f} req/s, p99 {snap_p99:.1f} ms",
            "healthz": f"{probe_rps:,.0f} req/s, p99 {probe_p99:.1f} ms",
        },
        ratio=ratio,
        met=ratio >= THROUGHPUT_TARGET,
    )


def idle_cost() -> Finding:
    with tempfile.TemporaryDirectory() as tmp, serve(pathlib.Path(tmp)) as (proc, _, _):
        process = psutil.Process(proc.pid)
        time.sleep(2)  # let start-up work (imports, first probe) finish
        before = process.cpu_times()
        time.sleep(IDLE_SECONDS)
        after = process.cpu_times()
        rss = process.memory_info().rss
    cpu = (after.user - before.user) + (after.system - before.system)
    share = cpu / IDLE_SECONDS
    return Finding(
        name=f"idle daemon over {IDLE_SECONDS} s (serve --devices sim)",
        target=f"< {IDLE_CPU_TARGET:.0%} of one core",
        figures={"cpu": f"{cpu:.3f} s ({share:.2%} of a core)", "rss": f"{rss / 2**20:.0f} MiB"},
        ratio=share / IDLE_CPU_TARGET,
        met=share < IDLE_CPU_TARGET,
    )


def run() -> list[Finding]:
    return [throughput(), idle_cost()]
