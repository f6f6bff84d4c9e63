"""Lane tenancy through the HTTP API, before and after, side by side in one run.

Two `serve --devices sim` daemons run at once on 127.0.0.1 (port 0), each in
a state directory of its own:

- the baseline: a revision of the project (`7f7e410` by default, the last one
  with one shared lane host per lane) materialised with
  `git archive REV | tar -x` into a temporary directory;
- the current code: this checkout's working tree (or another revision).

Each runs as `python -P -m node serve` with PYTHONPATH naming its own tree
only, so neither imports the other's packages (nor the editable install's);
the bench checks where every package resolves from before it starts them.
In each daemon two invocations hold the same simulated GPU lane (shared
isolation, so they pack onto one GPU), each with its own capability token:

1. tenant B's lane-work `noop` round trip on the otherwise idle lane (median
   and p99, one keep-alive client);
2. B's 1 MiB upload (octet-stream PUT) and 1 MiB download (GET) of its own
   buffer (median time, as throughput);
3. the noisy neighbour: tenant A keeps the lane saturated with float32
   matmuls, back to back from a thread on a connection of its own, each sized
   to take about SLICE_TARGET (timed on the baseline's idle lane, so in a lane
   host's own environment; both daemons get the same size), while B measures
   its `noop` round trip again. The kernel slice is A's median matmul round trip
   during the same phase; B's p99 is held to the issue's target, 2x the idle
   p99 plus one slice.

The daemons are measured in turn within each round (the order alternating
round by round), so drift in the machine's load falls on both alike. Every
HTTP call has a timeout, the whole run a deadline (RUN_SECONDS), and both
daemons are stopped however the run ends.

Choosing the revisions: `python -m bench.bench_lanes --baseline REV
[--current REV]` prints the findings; through `python -m bench.run_all
bench_lanes` (which writes RESULTS.md) the environment variables
LITEGRAPH_BENCH_BASELINE and LITEGRAPH_BENCH_CURRENT do the same. The current
code is the working tree unless a revision is named.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import filecmp
import http.client
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil  # type: ignore[import-untyped,unused-ignore]

from bench.harness import Finding, KeepAliveClient, percentile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("capabilities", "machine", "lanehost", "supervisor", "api", "node")

DEFAULT_BASELINE = "7f7e410"  # the last commit before lane sessions
ENV_BASELINE = "LITEGRAPH_BENCH_BASELINE"
ENV_CURRENT = "LITEGRAPH_BENCH_CURRENT"  # a revision; unset: the working tree

RUN_SECONDS = 150.0  # the whole bench, daemons' start and stop included
START_SECONDS = 45.0  # for a daemon to answer /readyz 200
HTTP_TIMEOUT = 30.0  # any one HTTP call (a matmul takes a fraction of a second)
STOP_SECONDS = 20.0  # after SIGTERM, before SIGKILL

ROUNDS = 3
IDLE_WARMUP = 100  # noops per daemon before the first timed round
ROUND_WARMUP = 20  # noops at the start of each later round (a fresh connection)
IDLE_CALLS = 250  # timed noops per round
TRANSFER_BYTES = 1 << 20
TRANSFERS = 15  # uploads and downloads per round
NOISY_SECONDS = 6.0  # B's measuring window per round, with A saturating the lane
B_PAUSE = 0.005  # B waits uniform(0, B_PAUSE) between its noops, so it does not
# lock step with A's kernels
SLICE_TARGET = 0.15  # seconds one matmul of A should take here
PROBE_CALLS = 8  # matmuls of the probe size that set the size
SLICE_SIZES = (512, 4096)  # the matmul's n is kept in this range, a multiple of 128

IDLE_TARGET = 1.2  # current median <= 1.2x the baseline's (see _IDLE_WHY)
TRANSFER_TARGET = 0.8  # current throughput >= 0.8x the baseline's
NOISY_TARGET = 1.0  # B's noisy p99 <= 2x idle p99 + one kernel slice

_IDLE_WHY = (
    "both keep one process hop per request (owner to the lane's host or to the "
    "invocation's lane session, over pipes), so the idle path should cost the same; "
    "the 20% is the run-to-run spread of a median on two shared cores"
)
_TRANSFER_WHY = (
    "the same bytes take the same copies (HTTP body, frame, pipe, buffer) whichever "
    "process holds the buffer; 20% for the spread of a 1 MiB transfer's median"
)
_NOISY_WHY = (
    "the issue's target: B may wait for at most the one kernel of A that is running "
    "when its request arrives (the slice, A's median matmul round trip in the same "
    "phase), and its own round trip may take twice the idle p99 for sharing the "
    "CPUs with that kernel"
)


class Deadline:
    """The whole run's deadline; every wait asks it how long it may take."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self, what: str) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"bench_lanes ran past its {self.seconds:.0f} s deadline ({what})")
        return remaining

    def timeout(self, what: str, most: float = HTTP_TIMEOUT) -> float:
        return min(most, self.left(what))


# -- the revisions -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Revision:
    label: str  # as the table shows it
    root: pathlib.Path  # the tree whose packages the daemon imports


def _git(*args: str) -> str:
    """A read-only git query about this checkout."""
    return subprocess.run(
        ["git", "-C", str(ROOT), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},  # never refresh the index
    ).stdout.strip()


def _materialise(rev: str, into: pathlib.Path) -> str:
    """`git archive REV | tar -x -C into`; the revision's short commit id."""
    try:
        commit = _git("rev-parse", "--short", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"bench_lanes: no commit {rev!r} in {ROOT}: {e.stderr.strip()}") from e
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit],
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, timeout=60, check=True)
    return commit


def _working_tree_label() -> str:
    head = _git("rev-parse", "--short", "HEAD")
    changed = [
        line for line in _git("status", "--porcelain", "--untracked-files=normal").splitlines()
    ]
    runtime = [line for line in changed if line[3:].split("/", 1)[0] in PACKAGES]
    return f"current (working tree on {head}" + (", changed)" if runtime else ")")


def _environment(root: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LITEGRAPH_")}
    env["PYTHONPATH"] = str(root)  # lane hosts inherit it (absolute entries only)
    env.pop("PYTHONHOME", None)
    return env


_WHERE = (
    "import importlib, json, sys\n"
    "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))\n"
)


def _check_imports(rev: Revision) -> None:
    """Every package the daemon runs resolves inside `rev.root`, as the daemon would see it."""
    out = subprocess.run(
        [sys.executable, "-P", "-c", _WHERE, *PACKAGES],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=rev.root,
        env=_environment(rev.root),
    ).stdout
    where = json.loads(out)
    stray = {m: f for m, f in where.items() if not pathlib.Path(f).is_relative_to(rev.root)}
    if stray:
        raise RuntimeError(f"bench_lanes: {rev.label} would import from elsewhere: {stray}")


def _differing_files(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    """The runtime packages' files (not caches) that are not byte for byte the same."""

    def files(root: pathlib.Path) -> set[str]:
        found: set[str] = set()
        for package in PACKAGES:
            for path in (root / package).rglob("*"):
                if path.is_file() and "__pycache__" not in path.parts:
                    found.add(str(path.relative_to(root)))
        return found

    ours, theirs = files(a), files(b)
    differ = ours ^ theirs
    differ |= {p for p in ours & theirs if not filecmp.cmp(a / p, b / p, shallow=False)}
    return sorted(differ)


# -- one daemon --------------------------------------------------------------


def _client(port: int, deadline: Deadline, label: str) -> KeepAliveClient:
    """A connection whose every call is bounded by the run's deadline."""
    return KeepAliveClient(port, label=f"bench_lanes: {label}", timeout=deadline.timeout)


class _Daemon:
    """`python -P -m node serve --devices sim` of one revision, on loopback."""

    def __init__(self, rev: Revision, workdir: pathlib.Path) -> None:
        self.rev = rev
        self.state_dir = workdir / "state"
        self.state_dir.mkdir(mode=0o700, parents=True)
        self.log_path = workdir / "daemon.log"
        self.port = 0
        argv = [sys.executable, "-P", "-m", "node", "serve", "--devices", "sim"]
        argv += ["--listen", "127.0.0.1:0", "--state-dir", str(self.state_dir)]
        # No grace on stop: the tenants' sleeps are cancelled at once.
        argv += ["--log-level", "warning", "--shutdown-grace", "0"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=rev.root,
                env=_environment(rev.root),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def wait_ready(self, deadline: Deadline) -> None:
        until = time.monotonic() + min(START_SECONDS, deadline.left(f"{self.rev.label} start"))
        process = psutil.Process(self.proc.pid)
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"bench_lanes: the {self.rev.label} daemon exited with "
                    f"{self.proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(psutil.Error):
                listening = [c for c in process.net_connections("tcp") if c.status == "LISTEN"]
                if listening:
                    self.port = listening[0].laddr.port
            if self.port:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                with contextlib.suppress(OSError, http.client.HTTPException):
                    conn.request("GET", "/readyz")
                    if conn.getresponse().status == 200:
                        conn.close()
                        return
                conn.close()
            time.sleep(0.1)
        raise RuntimeError(
            f"bench_lanes: the {self.rev.label} daemon was not ready in time:\n{self.log_tail()}"
        )

    @property
    def secret(self) -> str:
        return str(json.loads((self.state_dir / "auth.json").read_text())["scheduler"])

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, until: float) -> None:
        """Wait for it to exit until `until` (monotonic), then kill it."""
        try:
            self.proc.wait(timeout=max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)


def _stop_all(daemons: list[_Daemon]) -> None:
    """SIGTERM to all at once, then SIGKILL to any still running after STOP_SECONDS."""
    for daemon in daemons:
        daemon.terminate()
    until = time.monotonic() + STOP_SECONDS
    for daemon in daemons:
        daemon.stop(until)


@dataclasses.dataclass
class Samples:
    """Seconds per request, as tenant B's (and A's) client saw them."""

    idle: list[float] = dataclasses.field(default_factory=list)
    put: list[float] = dataclasses.field(default_factory=list)
    get: list[float] = dataclasses.field(default_factory=list)
    noisy: list[float] = dataclasses.field(default_factory=list)
    kernel: list[float] = dataclasses.field(default_factory=list)


class _Tenancy:
    """Two invocations, A and B, each with a token for the same GPU lane."""

    def __init__(self, daemon: _Daemon, deadline: Deadline) -> None:
        self.daemon, self.deadline = daemon, deadline
        self.samples = Samples()
        self.client = _client(daemon.port, deadline, daemon.rev.label)  # B's connection
        secret = daemon.secret
        largest = 3 * 4 * SLICE_SIZES[1] ** 2  # a, b and out at the largest n
        lane_a, token_a = self._submit(secret, "bench-lanes-a", largest + (64 << 20))
        lane_b, token_b = self._submit(secret, "bench-lanes-b", 16 << 20)
        if lane_a != lane_b:
            raise RuntimeError(
                f"bench_lanes: {daemon.rev.label} put the tenants on {lane_a} and {lane_b}"
            )
        self.lane = lane_a
        self.work = f"/v1/lanes/{self.lane}/work"
        self.auth_a = {"Authorization": f"Bearer {token_a}", "Content-Type": "application/json"}
        self.auth_b = {"Authorization": f"Bearer {token_b}", "Content-Type": "application/json"}
        self.octets_b = {**self.auth_b, "Content-Type": "application/octet-stream"}
        self.noop = json.dumps({"op": "execute", "kernel": "noop"}).encode()
        self.n = 0
        self.matmul = b""
        self._matrices: list[str] = []
        buffer_b = self._reserve(self.auth_b, "uint8", [TRANSFER_BYTES])
        self.buffer_b = f"/v1/lanes/{self.lane}/buffers/{buffer_b}"
        self.data = np.random.default_rng(3).integers(0, 256, TRANSFER_BYTES, np.uint8).tobytes()
        self.warmed = False

    def _submit(self, secret: str, invocation: str, vram: int) -> tuple[str, str]:
        body = {
            "id": invocation,
            "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": 600}},
            "requirement": "gpu",
            "isolation": "shared",
            # Lane sessions are charged to their invocation: simulated VRAM is host memory,
            # so the memory covers the VRAM filled; a whole machine of CPU for the
            # noisy tenant's matmuls (the worst case for its neighbour).
            "resources": {
                "cpu_millis": 2000,
                "memory_bytes": vram + 2**28,
                "gpus": 1,
                "vram_bytes": vram,
            },
        }
        reply = self.client.call(
            "POST",
            "/v1/invocations",
            body=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
            expect=202,
        )
        tokens = json.loads(reply)["tokens"]
        gpu = [(lane, token) for lane, token in tokens.items() if "cpu" not in lane]
        lane, token = (gpu or list(tokens.items()))[0]
        return str(lane), str(token)

    def use_matmul(self, n: int) -> None:
        """A's kernel from now on: a float32 (n, n) @ (n, n), on buffers of ones."""
        for buf in self._matrices:
            body = json.dumps({"op": "memory_release", "buffer_id": buf}).encode()
            self.client.call("POST", self.work, body=body, headers=self.auth_a)
        a, b, out = self._matrices = [self._reserve(self.auth_a, "float32", [n, n]) for _ in "abo"]
        for buf in (a, b):
            self._execute(self.auth_a, "fill", {"value": 1.0}, {"out": buf})
        self.n = n
        self.matmul = json.dumps(
            {"op": "execute", "kernel": "matmul", "buffers": {"a": a, "b": b, "out": out}}
        ).encode()

    def time_matmul(self, calls: int = 4) -> float:
        """The fastest of `calls` round trips of A's kernel on the otherwise idle lane."""
        self.client.call("POST", self.work, body=self.matmul, headers=self.auth_a)
        return min(
            self.client.timed("POST", self.work, body=self.matmul, headers=self.auth_a)
            for _ in range(calls)
        )

    def _reserve(self, auth: dict[str, str], dtype: str, shape: list[int]) -> str:
        body = json.dumps({"op": "memory_reserve", "dtype": dtype, "shape": shape}).encode()
        return str(
            json.loads(self.client.call("POST", self.work, body=body, headers=auth))["buffer_id"]
        )

    def _execute(
        self, auth: dict[str, str], kernel: str, args: dict[str, float], buffers: dict[str, str]
    ) -> None:
        body = {"op": "execute", "kernel": kernel, "args": args, "buffers": buffers}
        self.client.call("POST", self.work, body=json.dumps(body).encode(), headers=auth)

    def measure_round(self) -> None:
        label = self.daemon.rev.label
        c, s = self.client, self.samples
        # The server closes a keep-alive connection idle for a few seconds, as this one
        # was while the other daemon was measured: start each round on a fresh one.
        c.close()
        for _ in range(ROUND_WARMUP if self.warmed else IDLE_WARMUP):
            c.call("POST", self.work, body=self.noop, headers=self.auth_b)
        c.call("PUT", self.buffer_b, body=self.data, headers=self.octets_b)
        c.call("GET", f"{self.buffer_b}?length={TRANSFER_BYTES}", headers=self.auth_b)
        self.warmed = True
        self.deadline.left(f"{label} idle round")
        s.idle += [
            c.timed("POST", self.work, body=self.noop, headers=self.auth_b)
            for _ in range(IDLE_CALLS)
        ]
        s.put += [
            c.timed("PUT", self.buffer_b, body=self.data, headers=self.octets_b)
            for _ in range(TRANSFERS)
        ]
        got = f"{self.buffer_b}?length={TRANSFER_BYTES}"
        s.get += [c.timed("GET", got, headers=self.auth_b) for _ in range(TRANSFERS)]
        self._noisy_round()

    def _noisy_round(self) -> None:
        label = self.daemon.rev.label
        stop = threading.Event()
        kernels: list[float] = []
        failed: list[BaseException] = []

        def tenant_a() -> None:
            client = _client(self.daemon.port, self.deadline, f"{label}, tenant A")
            try:
                while not stop.is_set():
                    kernels.append(
                        client.timed("POST", self.work, body=self.matmul, headers=self.auth_a)
                    )
            except BaseException as e:  # reported by the measuring thread
                failed.append(e)
            finally:
                client.close()

        noisy = threading.Thread(target=tenant_a, name="bench-lanes-tenant-a", daemon=True)
        noisy.start()
        try:
            # A is saturating once its first kernel is done (BLAS threads up, lane busy).
            until = time.monotonic() + self.deadline.timeout(f"{label} tenant A's first kernel")
            while not kernels and not failed and time.monotonic() < until:
                time.sleep(0.01)
            if not kernels:
                raise RuntimeError(f"bench_lanes: tenant A's first matmul on {label}: {failed}")
            first = len(kernels)
            end = time.monotonic() + NOISY_SECONDS
            rng = random.Random(4)
            while time.monotonic() < end and not failed:
                self.deadline.left(f"{label} noisy round")
                self.samples.noisy.append(
                    self.client.timed("POST", self.work, body=self.noop, headers=self.auth_b)
                )
                time.sleep(rng.uniform(0, B_PAUSE))
            last = len(kernels)
        finally:
            stop.set()
            noisy.join(timeout=HTTP_TIMEOUT + 5)
        if failed:
            raise RuntimeError(f"bench_lanes: tenant A on {label} failed: {failed[0]!r}")
        if noisy.is_alive():
            raise RuntimeError(f"bench_lanes: tenant A on {label} did not stop")
        # A's kernels that ran while B measured; the one in flight at the end too.
        self.samples.kernel += kernels[first : last + 1]

    def close(self) -> None:
        self.client.close()


# -- the run -----------------------------------------------------------------


def matmul_size(tenancy: _Tenancy, target: float = SLICE_TARGET) -> tuple[int, int, float]:
    """(n, probe n, seconds): the n x n float32 matmul that should take about
    `target` on `tenancy`'s lane, from the fastest of PROBE_CALLS round trips of
    a probe size there. Timed in a lane host, not in this process: a host's
    environment is not this one (it drops OPENBLAS_* and the like), and NumPy's
    speed here need not be the host's. The fastest, since other load on the
    machine only makes a kernel slower; the slice the target uses is measured
    again while A runs."""
    probe = 2048  # tens of ms: long enough for a steady figure, short enough to repeat
    tenancy.use_matmul(probe)
    seconds = tenancy.time_matmul(PROBE_CALLS)
    n = round(probe * (target / seconds) ** (1 / 3) / 128) * 128
    n = max(SLICE_SIZES[0], min(SLICE_SIZES[1], n))
    if n != probe:
        tenancy.use_matmul(n)
    return n, probe, seconds


@dataclasses.dataclass
class Measured:
    baseline: Revision
    current: Revision
    samples: dict[str, Samples]  # by label
    n: int
    probe: tuple[int, float]  # (n, fastest round trip) of the sizing matmul, baseline lane
    differing: list[str]  # runtime files not the same in both trees
    seconds: float  # the whole run


def measure(baseline_rev: str, current_rev: str | None) -> Measured:
    deadline = Deadline(RUN_SECONDS)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        tmp = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-lanes-")))
        (tmp / "baseline-tree").mkdir()
        commit = _materialise(baseline_rev, tmp / "baseline-tree")
        baseline = Revision(f"baseline {commit}", tmp / "baseline-tree")
        if current_rev is None:
            current = Revision(_working_tree_label(), ROOT)
        else:
            (tmp / "current-tree").mkdir()
            current = Revision(
                f"current {_materialise(current_rev, tmp / 'current-tree')}", tmp / "current-tree"
            )
        for rev in (baseline, current):
            _check_imports(rev)
        differing = _differing_files(baseline.root, current.root)
        daemons: list[_Daemon] = []
        stack.callback(_stop_all, daemons)  # however the run ends
        for i, rev in enumerate((baseline, current)):
            daemons.append(_Daemon(rev, tmp / f"daemon-{i}"))
        tenancies: list[_Tenancy] = []
        try:
            for daemon in daemons:
                daemon.wait_ready(deadline)
                tenancy = _Tenancy(daemon, deadline)
                stack.callback(tenancy.close)
                tenancies.append(tenancy)
            # Sized on the baseline's lane while nothing else runs; both get the same n.
            n, probe_n, probe_seconds = matmul_size(tenancies[0])
            for tenancy in tenancies[1:]:
                tenancy.use_matmul(n)
            for round_ in range(ROUNDS):
                order = tenancies if round_ % 2 == 0 else tenancies[::-1]
                for tenancy in order:
                    print(
                        f"  round {round_ + 1}/{ROUNDS}: {tenancy.daemon.rev.label}",
                        file=sys.stderr,
                        flush=True,
                    )
                    tenancy.measure_round()
        except Exception as e:
            for daemon in daemons:  # what the daemons said, before they are stopped
                e.add_note(f"--- {daemon.rev.label} daemon's log (tail) ---\n{daemon.log_tail()}")
            raise
        samples = {t.daemon.rev.label: t.samples for t in tenancies}
    return Measured(
        baseline=baseline,
        current=current,
        samples=samples,
        n=n,
        probe=(probe_n, probe_seconds),
        differing=differing,
        seconds=time.monotonic() - started,
    )


# -- the findings ------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def _mbps(seconds: float) -> str:
    return f"{TRANSFER_BYTES / seconds / 1e6:,.0f} MB/s ({_ms(seconds)})"


def _p99(samples: list[float]) -> float:
    return percentile(samples, 99)


@dataclasses.dataclass(frozen=True)
class Noisy:
    idle_p99: float
    noisy_p99: float
    noisy_median: float
    slice: float
    kernel_p99: float
    n_noisy: int
    n_kernels: int

    @property
    def bound(self) -> float:
        return 2 * self.idle_p99 + self.slice


def noisy(s: Samples) -> Noisy:
    return Noisy(
        idle_p99=_p99(s.idle),
        noisy_p99=_p99(s.noisy),
        noisy_median=statistics.median(s.noisy),
        slice=statistics.median(s.kernel),
        kernel_p99=_p99(s.kernel),
        n_noisy=len(s.noisy),
        n_kernels=len(s.kernel),
    )


_LAST: dict[str, Measured] = {}  # the figures the notes cite


def findings(m: Measured) -> list[Finding]:
    base, cur = m.samples[m.baseline.label], m.samples[m.current.label]
    b_label, c_label = m.baseline.label, m.current.label

    def idle(s: Samples) -> str:
        return f"median {_ms(statistics.median(s.idle))}, p99 {_ms(_p99(s.idle))}"

    idle_ratio = statistics.median(cur.idle) / statistics.median(base.idle)
    put_ratio = statistics.median(base.put) / statistics.median(cur.put)
    get_ratio = statistics.median(base.get) / statistics.median(cur.get)
    rounds = f"{ROUNDS} rounds, daemons in turn, order alternating"
    rows = [
        Finding(
            name="lane work `noop` round trip on an idle lane (tenant B, one keep-alive client)",
            target=f"current median <= {IDLE_TARGET}x the baseline's: {_IDLE_WHY}",
            figures={
                b_label: idle(base),
                c_label: idle(cur),
                "samples": f"n={len(cur.idle)} each, {rounds}, after {IDLE_WARMUP} warm-up",
            },
            ratio=idle_ratio,
            met=idle_ratio <= IDLE_TARGET,
        ),
        Finding(
            name="1 MiB upload (octet-stream PUT) through the API",
            target=f"current throughput >= {TRANSFER_TARGET}x the baseline's: {_TRANSFER_WHY}",
            figures={
                b_label: _mbps(statistics.median(base.put)),
                c_label: _mbps(statistics.median(cur.put)),
                "samples": f"n={len(cur.put)} each, median",
            },
            ratio=put_ratio,
            met=put_ratio >= TRANSFER_TARGET,
        ),
        Finding(
            name="1 MiB download (GET) through the API",
            target=f"current throughput >= {TRANSFER_TARGET}x the baseline's (as for the upload)",
            figures={
                b_label: _mbps(statistics.median(base.get)),
                c_label: _mbps(statistics.median(cur.get)),
                "samples": f"n={len(cur.get)} each, median",
            },
            ratio=get_ratio,
            met=get_ratio >= TRANSFER_TARGET,
        ),
    ]
    for rev in (m.baseline, m.current):
        x = noisy(m.samples[rev.label])
        ratio = x.noisy_p99 / x.bound
        rows.append(
            Finding(
                name=(
                    "noisy neighbour: B's `noop` p99 while A saturates the same lane with "
                    f"{m.n}x{m.n} float32 matmuls, {rev.label}"
                ),
                target=f"p99 <= 2x the idle p99 + one kernel slice: {_NOISY_WHY}",
                figures={
                    "B noisy": (
                        f"p99 {_ms(x.noisy_p99)} ({x.noisy_p99 / x.idle_p99:,.1f}x the idle"
                        f" p99), median {_ms(x.noisy_median)}, n={x.n_noisy}"
                    ),
                    "B idle": f"p99 {_ms(x.idle_p99)}",
                    "slice": (
                        f"A's median matmul round trip {_ms(x.slice)} (p99"
                        f" {_ms(x.kernel_p99)}), n={x.n_kernels}"
                    ),
                    "bound": f"2x idle p99 + slice = {_ms(x.bound)}",
                },
                ratio=ratio,
                met=ratio <= NOISY_TARGET,
            )
        )
    return rows


def run() -> list[Finding]:
    baseline = os.environ.get(ENV_BASELINE) or DEFAULT_BASELINE
    current = os.environ.get(ENV_CURRENT) or None
    m = measure(baseline, current)
    _LAST["run"] = m
    return findings(m)


def notes(rows: list[Finding]) -> list[str]:
    """How the run was set up, and what bounds a missed target, in figures from this run."""
    m = _LAST.get("run")
    if m is None:
        return []
    if m.differing:
        shown = ", ".join(m.differing[:8]) + (" ..." if len(m.differing) > 8 else "")
        same = f"differ in {len(m.differing)} files ({shown})"
    else:
        same = "are byte for byte the same, so the two columns should agree"
    out = [
        f"Revisions: {m.baseline.label} (`git archive` into a temporary directory) and"
        f" {m.current.label}. The runtime packages ({', '.join(PACKAGES)}) of the two {same}."
        f" Each daemon ran `python -P -m node serve --devices sim` with PYTHONPATH naming its"
        f" tree alone. A's matmul is {m.n}x{m.n} float32, sized on the idle baseline lane"
        f" for about {_ms(SLICE_TARGET)} from the fastest of {PROBE_CALLS} round trips of a"
        f" {m.probe[0]}x{m.probe[0]} one there ({_ms(m.probe[1])}); B paused"
        f" uniform(0, {B_PAUSE * 1e3:.0f} ms) between its noops while A ran."
        f" The run took {m.seconds:.0f} s."
    ]
    for f in rows:
        if f.met:
            continue
        if not f.name.startswith("noisy neighbour"):
            cause = (
                "the code differs, so this may be the change's cost"
                if m.differing
                else "the code is the same, so this is the spread of two shared cores"
            )
            out.append(f"Missed: {f.name} at {f.ratio:.2f}x the baseline; {cause}.")
            continue
        rev = m.baseline if f.name.endswith(m.baseline.label) else m.current
        x = noisy(m.samples[rev.label])
        slices = x.noisy_median / x.slice
        if slices >= 0.5:  # B waits for A's kernels
            why = (
                f" B's median {_ms(x.noisy_median)} is {slices:.2f} slices: the lane's work"
                " goes through one queue to one process, so B's noop waits for the matmul"
                " of A that is running when it arrives. The p99 passes the bound where that"
                f" matmul runs long (A's p99 {_ms(x.kernel_p99)}), or where A's next one is"
                " queued before B's noop."
            )
        else:  # B does not wait for A's kernels: it waits for a CPU
            why = (
                f" B's median {_ms(x.noisy_median)} is {slices:.2f} slices, so B's noop does"
                " not wait for A's kernels; its tail is the daemon and the process serving B"
                " waiting for a CPU while A's matmul holds both cores (BLAS threads)."
            )
        out.append(
            f"Missed: the noisy neighbour on {rev.label}: B's p99 {_ms(x.noisy_p99)} against"
            f" a bound of {_ms(x.bound)} (A's median slice {_ms(x.slice)})." + why
        )
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_lanes", description=__doc__)
    parser.add_argument("--baseline", default=os.environ.get(ENV_BASELINE) or DEFAULT_BASELINE)
    parser.add_argument(
        "--current", default=os.environ.get(ENV_CURRENT) or None, help="default: the working tree"
    )
    args = parser.parse_args(argv)
    m = measure(args.baseline, args.current)
    _LAST["run"] = m
    rows = findings(m)
    for row in rows:
        print(row)
    for note in notes(rows):
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
