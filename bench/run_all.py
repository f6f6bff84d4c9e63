"""Runs every bench/bench_*.py and rewrites bench/RESULTS.md with the figures."""

from __future__ import annotations

import datetime
import importlib
import os
import pathlib
import platform
import sys

import psutil

from bench.harness import Finding

HERE = pathlib.Path(__file__).resolve().parent


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    mem = psutil.virtual_memory().total / 2**30
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} logical cores ({cpu}), "
        f"{mem:.0f} GiB RAM, Python {platform.python_version()}"
    )


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"


def render(
    results: dict[str, list[Finding]],
    loads: dict[str, tuple[str, str]] | None = None,
    notes: dict[str, list[str]] | None = None,
) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark results",
        "",
        "Written by `make bench` (bench/run_all.py); do not edit by hand.",
        "",
        f"Measured {now} on {machine()}.",
        "",
    ]
    for module, findings in results.items():
        lines += [f"## {module}", ""]
        if loads and module in loads:
            before, after = loads[module]
            lines += [f"Load average: {before} before, {after} after.", ""]
        lines += [
            "| benchmark | figures | ratio | target | met |",
            "|---|---|---|---|---|",
        ]
        for f in findings:
            figures = "; ".join(f"{k}: {v}" for k, v in f.figures.items())
            met = "yes" if f.met else "no"
            lines.append(f"| {f.name} | {figures} | {f.ratio:.2f} | {f.target} | {met} |")
        lines.append("")
        for note in (notes or {}).get(module, []):
            lines += [note, ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    only = set(argv)
    results: dict[str, list[Finding]] = {}
    loads: dict[str, tuple[str, str]] = {}
    notes: dict[str, list[str]] = {}
    for path in sorted(HERE.glob("bench_*.py")):
        if only and path.stem not in only:
            continue
        module = importlib.import_module(f"bench.{path.stem}")
        print(f"running {path.stem} ...", file=sys.stderr, flush=True)
        before = load()
        results[path.stem] = module.run()
        loads[path.stem] = (before, load())
        if hasattr(module, "notes"):  # what bounds a missed target, in words
            notes[path.stem] = module.notes(results[path.stem])
        for f in results[path.stem]:
            print(
                f"  {f.name}: ratio {f.ratio:.2f} ({'met' if f.met else 'NOT met'})",
                file=sys.stderr,
            )
    text = render(results, loads, notes)
    if (HERE / "RESULTS.md").exists():
        # Sections of modules that did not run are kept, and so are those no module
        # writes (such as `make certify-gpu`'s record of a run on a real GPU).
        text = merge((HERE / "RESULTS.md").read_text(), text)
    (HERE / "RESULTS.md").write_text(text)
    return 0


def _sections(text: str) -> tuple[str, dict[str, str]]:
    """(the head before the first module, module -> its section), in order."""
    head, *parts = text.split("\n## ")
    return head, {part.split("\n", 1)[0]: "## " + part for part in parts}


def merge(old: str, new: str) -> str:
    """`old` with the modules measured in `new` replaced (or added), each section
    saying when it was measured; the other sections are kept as they were."""
    old_head, kept = _sections(old)
    new_head, fresh = _sections(new)
    measured = next(line for line in new_head.splitlines() if line.startswith("Measured "))
    for module, section in fresh.items():
        title, _, body = section.partition("\n")
        kept[module] = f"{title}\n\n{measured}\n{body}"
    return "\n## ".join([old_head.rstrip("\n") + "\n", *(s[3:] for s in kept.values())])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
