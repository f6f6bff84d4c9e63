"""Certify the node's GPU path on a real machine: one PASS, FAIL, WARN or SKIP line
per check in `<results>/summary.txt`, the evidence beside it.

Run through `make certify-gpu` (it prepares the virtual environment, offline from
a folder of wheels with WHEELS=dir). `--devices sim` is the dry run any machine can
do: the checks that need NVML or CUDA say SKIP, the rest run against the simulated
GPUs. Exit status 1 when any check FAILs.

Checks: driver and device facts (`nvidia-smi -q`, NVML versions, every NVML call
the node makes on every GPU and MIG handle with its raw answer or error);
`snapshot` as root and as an unprivileged uid; `pytest -m cuda`; through the HTTP
API of a real `serve`, a 4096x4096 float32 and float16 matmul on a GPU lane checked
against NumPy, the lane's backend, the ledger's VRAM against NVML's used memory
before and after the buffers are freed; and a `/metrics` scrape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
NODE = [sys.executable, "-m", "node"]
N = 4096
# The dry run multiplies smaller matrices: NumPy's float16 matmul has no BLAS.
DRY_RUN_N = 512
STEP_SECONDS = 120  # any one command; the whole run stays within 8 minutes
UNPRIVILEGED = "65534"  # nobody


class Results:
    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.lines: list[str] = []

    def record(self, verdict: str, name: str, detail: str) -> None:
        line = f"{verdict} {name}: {detail}"
        self.lines.append(line)
        print(line, flush=True)
        (self.folder / "summary.txt").write_text("\n".join(self.lines) + "\n")

    def evidence(self, name: str, text: str) -> None:
        (self.folder / name).write_text(text)

    @property
    def failed(self) -> bool:
        return any(line.startswith("FAIL ") for line in self.lines)


def check(results: Results, name: str, run: Callable[[], tuple[str, str]]) -> None:
    """Run one check; an exception is its FAIL, with the reason."""
    try:
        verdict, detail = run()
    except Exception as exc:  # one check failing must not stop the others
        verdict, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    results.record(verdict, name, detail)


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=STEP_SECONDS, check=False, **kw
    )


# -- facts --------------------------------------------------------------------------------


def nvidia_smi(results: Results) -> tuple[str, str]:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return "SKIP", "no nvidia-smi on PATH"
    answer = _run([tool, "-q"])
    results.evidence("nvidia-smi.txt", answer.stdout + answer.stderr)
    if answer.returncode != 0:
        return "FAIL", f"nvidia-smi -q exited {answer.returncode}"
    return "PASS", "nvidia-smi -q saved to nvidia-smi.txt"


def _answer(call: Callable[[], Any]) -> Any:
    try:
        value = call()
    except Exception as exc:  # the raw error is the evidence
        return {"error": type(exc).__name__, "text": str(exc)}
    if hasattr(value, "_fields_"):
        return {field: repr(getattr(value, field)) for field, *_ in value._fields_}
    return repr(value)


def _handle_calls(nvml: Any, handle: Any) -> dict[str, Any]:
    """Every per-handle call the node makes (machine/discovery_nvml.py)."""
    calls: dict[str, Callable[[], Any]] = {
        "nvmlDeviceGetUUID": lambda: nvml.nvmlDeviceGetUUID(handle),
        "nvmlDeviceGetName": lambda: nvml.nvmlDeviceGetName(handle),
        "nvmlDeviceGetPciInfo": lambda: nvml.nvmlDeviceGetPciInfo(handle),
        "nvmlDeviceGetMemoryInfo": lambda: nvml.nvmlDeviceGetMemoryInfo(handle),
        "nvmlDeviceGetMemoryInfo_v2": lambda: nvml.nvmlDeviceGetMemoryInfo(
            handle, version=nvml.nvmlMemory_v2
        ),
        "nvmlDeviceGetCudaComputeCapability": lambda: nvml.nvmlDeviceGetCudaComputeCapability(
            handle
        ),
        "nvmlDeviceGetMigMode": lambda: nvml.nvmlDeviceGetMigMode(handle),
        "nvmlDeviceGetMinorNumber": lambda: nvml.nvmlDeviceGetMinorNumber(handle),
        "nvmlDeviceGetTemperatureThreshold": lambda: nvml.nvmlDeviceGetTemperatureThreshold(
            handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        ),
        "nvmlDeviceGetTemperature": lambda: nvml.nvmlDeviceGetTemperature(
            handle, nvml.NVML_TEMPERATURE_GPU
        ),
        "nvmlDeviceGetPowerUsage": lambda: nvml.nvmlDeviceGetPowerUsage(handle),
        "nvmlDeviceGetUtilizationRates": lambda: nvml.nvmlDeviceGetUtilizationRates(handle),
        "nvmlDeviceGetClockInfo_SM": lambda: nvml.nvmlDeviceGetClockInfo(
            handle, nvml.NVML_CLOCK_SM
        ),
        "nvmlDeviceGetClockInfo_MEM": lambda: nvml.nvmlDeviceGetClockInfo(
            handle, nvml.NVML_CLOCK_MEM
        ),
        "nvmlDeviceGetTotalEccErrors": lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        ),
        "nvmlDeviceGetRetiredPagesPendingStatus": (
            lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)
        ),
        "nvmlDeviceGetRemappedRows": lambda: nvml.nvmlDeviceGetRemappedRows(handle),
        "nvmlDeviceGetMaxMigDeviceCount": lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle),
        "nvmlDeviceGetGpuInstanceId": lambda: nvml.nvmlDeviceGetGpuInstanceId(handle),
        "nvmlDeviceGetComputeInstanceId": lambda: nvml.nvmlDeviceGetComputeInstanceId(handle),
        "nvmlDeviceGetSupportedEventTypes": lambda: nvml.nvmlDeviceGetSupportedEventTypes(handle),
    }
    return {name: _answer(call) for name, call in calls.items()}


def nvml_facts(results: Results) -> tuple[str, str]:
    try:
        import pynvml as nvml
    except ImportError:
        return "SKIP", "nvidia-ml-py is not installed"
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return "FAIL", f"nvmlInit: {type(exc).__name__}: {exc}"
    try:
        facts: dict[str, Any] = {
            "driver": _answer(nvml.nvmlSystemGetDriverVersion),
            "cuda_driver": _answer(nvml.nvmlSystemGetCudaDriverVersion),
            "devices": [],
        }
        count = nvml.nvmlDeviceGetCount()
        migs = 0
        for index in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            calls = _handle_calls(nvml, handle)
            instances: list[dict[str, Any]] = []
            max_mig = calls["nvmlDeviceGetMaxMigDeviceCount"]
            slots = int(max_mig) if isinstance(max_mig, str) and max_mig.isdigit() else 0
            for slot in range(slots):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except Exception as exc:
                    instances.append({"slot": slot, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                migs += 1
                instances.append({"slot": slot, "calls": _handle_calls(nvml, mig)})
            facts["devices"].append({"index": index, "calls": calls, "mig": instances})
        results.evidence("nvml-calls.json", json.dumps(facts, indent=2))
    finally:
        nvml.nvmlShutdown()
    return "PASS", f"{count} GPU(s), {migs} MIG instance(s); every call in nvml-calls.json"


# -- snapshot -----------------------------------------------------------------------------


def _snapshot(devices: str, state: pathlib.Path, *, unprivileged: bool) -> dict[str, Any]:
    argv = [*NODE, "snapshot", "--devices", devices, "--state-dir", str(state)]
    if unprivileged:
        argv = [
            "setpriv",
            f"--reuid={UNPRIVILEGED}",
            f"--regid={UNPRIVILEGED}",
            "--clear-groups",
            *argv,
        ]
    answer = _run(argv, cwd=ROOT, env={**os.environ, "HOME": str(state)})
    if answer.returncode != 0:
        raise RuntimeError(f"snapshot exited {answer.returncode}: {answer.stderr[-400:]}")
    snapshot: dict[str, Any] = json.loads(answer.stdout)
    return snapshot


def _lanes(snapshot: dict[str, Any]) -> list[str]:
    return sorted(f"{lane['kind']}:{lane['health']}" for lane in snapshot["lanes"])


def snapshots(results: Results, devices: str, scratch: pathlib.Path) -> tuple[str, str]:
    root = _snapshot(devices, scratch / "root-state", unprivileged=False)
    results.evidence("snapshot-root.json", json.dumps(root, indent=2))
    gpus = [lane for lane in root["lanes"] if lane["kind"] != "cpu"]
    if not gpus:
        return "FAIL", f"no GPU lanes (readiness: {root['readiness_reasons']})"
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return (
            "WARN",
            f"{len(gpus)} GPU lane(s) as root; not root or no setpriv: no unprivileged run",
        )
    other = scratch / "nobody-state"
    other.mkdir(mode=0o700)
    os.chown(other, int(UNPRIVILEGED), int(UNPRIVILEGED))
    mine = _snapshot(devices, other, unprivileged=True)
    results.evidence("snapshot-unprivileged.json", json.dumps(mine, indent=2))
    if _lanes(mine) != _lanes(root):
        return "FAIL", f"as uid {UNPRIVILEGED}: lanes {_lanes(mine)}, as root {_lanes(root)}"
    return "PASS", f"{len(gpus)} GPU lane(s), the same as root and as uid {UNPRIVILEGED}"


# -- pytest -m cuda -----------------------------------------------------------------------


def cuda_tests(results: Results) -> tuple[str, str]:
    answer = _run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rs"],
        cwd=ROOT,
    )
    results.evidence("pytest-cuda.txt", answer.stdout + answer.stderr)
    last = (answer.stdout.strip().splitlines() or ["(no output)"])[-1]
    if answer.returncode not in (0, 5):
        return "FAIL", last
    if "passed" not in last:
        return "SKIP", f"no CUDA test ran ({last})"
    return ("WARN" if "skipped" in last else "PASS"), last


# -- the API ------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(
    devices: str, state: pathlib.Path, log_path: pathlib.Path
) -> Iterator[tuple[str, str, str]]:
    """A `serve` of its own: (url, scheduler secret, admin secret)."""
    argv = [
        *NODE,
        "serve",
        "--devices",
        devices,
        "--state-dir",
        str(state),
        "--listen",
        "127.0.0.1:0",
        "--no-metrics-auth",
    ]
    log = log_path.open("w")
    daemon = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        address = state / "address.json"
        deadline = time.monotonic() + STEP_SECONDS
        while not address.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start (see {log.name})")
            time.sleep(0.2)
        where = json.loads(address.read_text())
        auth = json.loads(pathlib.Path(where["auth_file"]).read_text())
        yield where["url"], auth["scheduler"], auth["admin"]
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()


def _nvml_used(device: str) -> int | None:
    try:
        import pynvml as nvml
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        used: int = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(device)).used
        return used
    finally:
        nvml.nvmlShutdown()


class Lane:
    """One GPU lane through the API, under an invocation's token."""

    def __init__(self, client: httpx.Client, lane_id: str, token: str, size: int) -> None:
        self.client, self.lane_id, self.size = client, lane_id, size
        self.auth = {"Authorization": f"Bearer {token}"}
        self.held: list[str] = []

    def work(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.client.post(f"/v1/lanes/{self.lane_id}/work", json=body, headers=self.auth)
        if reply.status_code != 200:
            raise RuntimeError(f"{body['op']}: {reply.status_code} {reply.text[:300]}")
        answer: dict[str, Any] = reply.json()
        return answer

    def buffer(self, dtype: str) -> str:
        reply = self.work({"op": "memory_reserve", "dtype": dtype, "shape": [self.size] * 2})
        self.held.append(str(reply["buffer_id"]))
        return self.held[-1]

    def release_all(self) -> None:
        while self.held:
            self.work({"op": "memory_release", "buffer_id": self.held.pop()})

    def put(self, buffer_id: str, values: np.ndarray[Any, Any]) -> None:
        reply = self.client.put(
            f"/v1/lanes/{self.lane_id}/buffers/{buffer_id}",
            content=values.tobytes(),
            headers={**self.auth, "Content-Type": "application/octet-stream"},
        )
        if reply.status_code != 200:
            raise RuntimeError(f"upload: {reply.status_code} {reply.text[:300]}")

    def get(self, buffer_id: str, dtype: str) -> np.ndarray[Any, Any]:
        length = self.size**2 * np.dtype(dtype).itemsize
        reply = self.client.get(
            f"/v1/lanes/{self.lane_id}/buffers/{buffer_id}?length={length}", headers=self.auth
        )
        if reply.status_code != 200:
            raise RuntimeError(f"download: {reply.status_code} {reply.text[:300]}")
        return np.frombuffer(reply.content, dtype).reshape(self.size, self.size)


def _matmul(lane: Lane, dtype: str, rng: np.random.Generator) -> str:
    shape = (lane.size, lane.size)
    a = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    b = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    ids = {name: lane.buffer(dtype) for name in ("a", "b", "out")}
    lane.put(ids["a"], a)
    lane.put(ids["b"], b)
    started = time.perf_counter()
    lane.work({"op": "execute", "kernel": "matmul", "args": {}, "buffers": ids})
    seconds = time.perf_counter() - started
    got = lane.get(ids["out"], dtype).astype(np.float32)
    want = a.astype(np.float32) @ b.astype(np.float32)
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    bound = 1e-4 if dtype == "float32" else 1e-2
    if not error <= bound:
        raise AssertionError(f"{dtype} matmul: max relative error {error:.2e} > {bound:.0e}")
    return f"{dtype} {lane.size}x{lane.size} in {seconds * 1000:.0f} ms, max rel. error {error:.1e}"


def _lane_vram(snapshot: dict[str, Any], lane_id: str) -> int:
    for lane in snapshot["capacity"]["vram_bytes"]:
        if lane["lane_id"] == lane_id:
            return int(lane["allocated"])
    raise KeyError(lane_id)


def through_the_api(results: Results, devices: str, scratch: pathlib.Path) -> None:
    state = scratch / "serve-state"
    with (
        serving(devices, state, results.folder / "serve.log") as (url, scheduler, _admin),
        httpx.Client(base_url=url, timeout=STEP_SECONDS) as client,
    ):
        operator = {"Authorization": f"Bearer {scheduler}"}
        body = {
            "id": "certify-matmul",
            "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": 300}},
            "requirement": "gpu",
            "resources": {
                "cpu_millis": 1000,  # the lane host's CPU is charged to it
                "memory_bytes": 1 << 30,
                "gpus": 1,
                "vram_bytes": 512 << 20,
            },
        }
        submitted = client.post("/v1/invocations", json=body, headers=operator)
        if submitted.status_code != 202:
            results.record(
                "FAIL", "api-matmul", f"submit: {submitted.status_code} {submitted.text}"
            )
            return
        (lane_id, token), *_ = submitted.json()["tokens"].items()
        lane = Lane(client, lane_id, token, N if devices == "nvml" else DRY_RUN_N)
        snapshot = client.get("/v1/snapshot", headers=operator).json()
        entry = next(item for item in snapshot["lanes"] if item["lane_id"] == lane_id)
        device = entry.get("mig_uuid") or entry["device_id"]
        backend = entry.get("backend", "(not reported)")
        want = "numpy" if devices == "sim" else "cupy"
        results.record(
            "PASS" if backend == want else "FAIL",
            "lane-backend",
            f"lane {lane_id} on {device}: {backend}",
        )
        rng = np.random.default_rng(7)
        before = _nvml_used(device)
        for dtype in ("float32", "float16"):

            def multiply(kind: str = dtype) -> tuple[str, str]:
                return "PASS", _matmul(lane, kind, rng)

            check(results, f"api-matmul-{dtype}", multiply)
        held = _lane_vram(client.get("/v1/snapshot", headers=operator).json(), lane_id)
        during = _nvml_used(device)
        lane.release_all()
        time.sleep(1)  # what the host's pool gives back shows in NVML's next reading
        after = _nvml_used(device)
        freed_buffers = client.get("/v1/snapshot", headers=operator).json()
        client.delete("/v1/invocations/certify-matmul", headers=operator)
        freed = _lane_vram(client.get("/v1/snapshot", headers=operator).json(), lane_id)
        results.evidence("snapshot-after-free.json", json.dumps(freed_buffers, indent=2))
        figures = f"ledger {held >> 20} MiB held, {freed >> 20} MiB after"
        if before is None or during is None or after is None:
            verdict = "SKIP" if devices == "sim" else "FAIL"
            results.record(verdict, "vram-ledger-vs-nvml", f"{figures}; NVML used not readable")
        else:
            figures += (
                f"; NVML used {before >> 20} MiB before, {during >> 20} during, {after >> 20} after"
            )
            drift = during - before - held
            ok = freed == 0 and abs(after - before) <= (64 << 20) and drift <= (1 << 30)
            results.record("PASS" if ok else "FAIL", "vram-ledger-vs-nvml", figures)
        metrics = client.get("/metrics")
        results.evidence("metrics.txt", metrics.text)
        names = {
            line.split("{")[0].split(" ")[0]
            for line in metrics.text.splitlines()
            if line and not line.startswith("#")
        }
        wanted = {"litegraph_capacity_vram_bytes", "litegraph_device_health", "DCGM_FI_DEV_FB_USED"}
        missing = sorted(wanted - names)
        results.record(
            "PASS" if metrics.status_code == 200 and not missing else "FAIL",
            "metrics",
            f"{metrics.status_code}, {len(names)} series"
            + (f"; missing {missing}" if missing else ""),
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="nvml", choices=("nvml", "sim"))
    parser.add_argument("--results", default=str(ROOT / "certify-results"))
    args = parser.parse_args(argv)
    results = Results(pathlib.Path(args.results))
    results.record("INFO", "machine", " ".join(os.uname()) + f", devices {args.devices}")
    with tempfile.TemporaryDirectory(prefix="certify-") as base:
        scratch = pathlib.Path(base)
        os.chmod(scratch, 0o755)  # noqa: S103 - the unprivileged snapshot reaches its folder
        if args.devices == "nvml":
            check(results, "nvidia-smi", lambda: nvidia_smi(results))
            check(results, "nvml-calls", lambda: nvml_facts(results))
        else:
            results.record("SKIP", "nvidia-smi", "dry run (--devices sim)")
            results.record("SKIP", "nvml-calls", "dry run (--devices sim)")
        check(results, "snapshot", lambda: snapshots(results, args.devices, scratch))
        check(results, "pytest-cuda", lambda: cuda_tests(results))
        try:
            through_the_api(results, args.devices, scratch)
        except Exception as exc:
            results.record("FAIL", "api", f"{type(exc).__name__}: {exc}")
    print(f"results in {results.folder}", flush=True)
    return 1 if results.failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
