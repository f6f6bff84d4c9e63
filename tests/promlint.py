"""`promtool check metrics` in Python: the rules of Prometheus' promlint
(client_golang prometheus/testutil/promlint/validations), applied to a text
exposition (format 0.0.4), for tests on machines without promtool.

The page is read as promtool's parser reads it: a family is named by its
`# TYPE` line (a counter's name ends `_total` there), and a sample belongs to
the family of the same name (a histogram's or summary's also under `_bucket`,
`_sum`, `_count`); any other sample starts an untyped family of its own. A
page that does not parse raises ValueError (promtool exits 1); each problem
is one `Problem` (promtool exits 3 when there is any). Beyond promlint, a
label name must be valid and not reserved (`__` prefix), and a series may not
appear twice (Prometheus refuses such a scrape).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Family", "Problem", "lint", "parse"]

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_SAMPLE = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<rest>\S.*)$")
_LABEL = re.compile(r'\s*(?P<name>[^=\s]+)\s*=\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*(?:,|$)')
_CAMEL_CASE = re.compile(r"[a-z][A-Z]")
TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
# promlint's MetricTypeInName skips untyped; the proto also names gauge_histogram.
_TYPE_WORDS = ("counter", "gauge", "histogram", "summary", "gauge_histogram")
_UNITS = {
    "amperes": "amperes",
    "bytes": "bytes",
    "celsius": "celsius",
    "grams": "grams",
    "joules": "joules",
    "kelvin": "kelvin",
    "meters": "meters",
    "metres": "metres",
    "seconds": "seconds",
    "volts": "volts",
    "minutes": "seconds",
    "hours": "seconds",
    "days": "seconds",
    "weeks": "seconds",
    "kelvins": "kelvin",
    "fahrenheit": "celsius",
    "rankine": "celsius",
    "inches": "meters",
    "yards": "meters",
    "miles": "meters",
    "bits": "bytes",
    "calories": "joules",
    "pounds": "grams",
    "ounces": "grams",
}
_UNIT_PREFIXES = (
    "pico",
    "nano",
    "micro",
    "milli",
    "centi",
    "deci",
    "deca",
    "hecto",
    "kilo",
    "kibi",
    "mega",
    "mibi",
    "giga",
    "gibi",
    "tera",
    "tebi",
    "peta",
    "pebi",
)
_UNIT_ABBREVIATIONS = (
    "s",
    "ms",
    "us",
    "ns",
    "sec",
    "b",
    "kb",
    "mb",
    "gb",
    "tb",
    "pb",
    "m",
    "h",
    "d",
)
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


@dataclasses.dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    # (sample name, labels) in page order.
    samples: list[tuple[str, dict[str, str]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, order=True)
class Problem:
    metric: str
    text: str


def parse(text: str) -> list[Family]:
    families: dict[str, Family] = {}
    current: Family | None = None

    def family(name: str) -> Family:
        if name not in families:
            families[name] = Family(name)
        return families[name]

    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # a comment
            name = parts[2]
            if not METRIC_NAME.fullmatch(name):
                raise ValueError(f"line {number}: invalid metric name {name!r}")
            found = family(name)
            if parts[1] == "HELP":
                if found.help is not None:
                    raise ValueError(f"line {number}: second HELP line for {name}")
                found.help = parts[3] if len(parts) > 3 else ""
            else:
                kind = parts[3].strip() if len(parts) > 3 else ""
                if kind not in TYPES:
                    raise ValueError(f"line {number}: unknown type {kind!r} for {name}")
                if found.samples:
                    raise ValueError(f"line {number}: TYPE for {name} after its samples")
                found.type = kind
            current = found
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"line {number}: not a sample: {line!r}")
        name = match["name"]
        labels = _labels(match["labels"] or "", number)
        owner = current if current is not None and _belongs(current, name) else family(name)
        owner.samples.append((name, labels))
        current = owner
    return list(families.values())


def _belongs(family: Family, name: str) -> bool:
    if name == family.name:
        return True
    return any(name == family.name + s for s in _SUFFIXES.get(family.type, ()))


def _labels(text: str, number: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    rest = text.strip()
    while rest:
        match = _LABEL.match(rest)
        if match is None:
            raise ValueError(f"line {number}: bad labels {text!r}")
        if match["name"] in labels:
            raise ValueError(f"line {number}: label {match['name']} twice")
        labels[match["name"]] = match["value"]
        rest = rest[match.end() :].strip()
    return labels


def lint(text: str) -> list[Problem]:
    """promlint's problems with the page, sorted as promtool prints them."""
    problems: list[Problem] = []
    for family in parse(text):
        problems += [Problem(family.name, t) for t in _lint_family(family)]
    return sorted(problems)


def _lint_family(f: Family) -> list[str]:
    name, kind = f.name, f.type
    found: list[str] = []
    if f.help is None:
        found.append("no help text")
    unit = _unit(name)
    if unit is not None and unit[0] != unit[1]:
        found.append(f'use base unit "{unit[1]}" instead of "{unit[0]}"')
    total = name.endswith("_total")
    if kind == "counter" and not total:
        found.append('counter metrics should have "_total" suffix')
    elif kind not in ("untyped", "counter") and total:
        found.append('non-counter metrics should not have "_total" suffix')
    label_names = {label for _, labels in f.samples for label in labels}
    if kind != "untyped":
        if kind != "histogram" and name.endswith("_bucket"):
            found.append('non-histogram metrics should not have "_bucket" suffix')
        for suffix in ("_count", "_sum"):
            if kind not in ("histogram", "summary") and name.endswith(suffix):
                found.append(
                    f'non-histogram and non-summary metrics should not have "{suffix}" suffix'
                )
        if kind != "histogram" and "le" in label_names:
            found.append('non-histogram metrics should not have "le" label')
        if kind != "summary" and "quantile" in label_names:
            found.append('non-summary metrics should not have "quantile" label')
    lower = name.lower()
    for word in _TYPE_WORDS:
        if f"_{word}_" in lower or lower.endswith(f"_{word}"):
            found.append(f"metric name should not include type '{word}'")
    if ":" in name:
        found.append("metric names should not contain ':'")
    if _CAMEL_CASE.search(name):
        found.append("metric names should be written in 'snake_case' not 'camelCase'")
    for label in sorted(label_names):
        if _CAMEL_CASE.search(label):
            found.append(f"label names should be written in 'snake_case' not 'camelCase': {label}")
        if not LABEL_NAME.fullmatch(label) or label.startswith("__"):
            found.append(f"invalid or reserved label name {label!r}")
    for abbreviation in _UNIT_ABBREVIATIONS:
        if f"_{abbreviation}_" in lower or lower.endswith(f"_{abbreviation}"):
            found.append("metric names should not contain abbreviated units")
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for sample, labels in f.samples:
        key = (sample, tuple(sorted(labels.items())))
        if key in seen:
            found.append(f"duplicate series {sample}{dict(key[1])}")
        seen.add(key)
    return found


def _unit(name: str) -> tuple[str, str] | None:
    """(unit, its base unit) of the first unit word in the name, as promlint finds it."""
    for word in name.split("_"):
        if word in _UNITS:
            return word, _UNITS[word]
        for prefix in _UNIT_PREFIXES:
            if word.startswith(prefix) and word[len(prefix) :] in _UNITS:
                return word, _UNITS[word[len(prefix) :]]
    return None
