"""Every CDI spec kubeplugin writes against the CDI specification's own JSON Schema
(tests/vectors/cdi-schema, unchanged from upstream: see its SOURCE.txt), resolved
offline: the schema's `defs.json` reference comes from the vector folder, never the
network. And the validator is shown to refuse a broken spec, so passing means the
schema was applied."""

from __future__ import annotations

import copy
import json
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jsonschema import Draft7Validator
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT7

from kubeplugin.cdi import CDI_VERSION, claim_spec, write_claim_spec

SCHEMA_DIR = pathlib.Path(__file__).resolve().parents[2] / "vectors" / "cdi-schema"
UID = "2f6b4c1e-8d0a-4b7e-9c61-0b5d3e1a7f42"
CLAIM_DIR = pathlib.Path("/var/lib/kubelet/plugins/lanes.litegraph.dev/claims") / UID
LANES = ("lane_0123456789abcdef",)

Spec = dict[str, Any]


def _load(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMA_DIR / name).read_text())
    return loaded


SCHEMA = _load("schema.json")
DEFS = _load("defs.json")
# schema.json has no $id, so its "defs.json#/..." references resolve to the URI
# "defs.json": that is the name it is registered under. defs.json declares no $schema,
# so its draft is given (schema.json's, draft 7). No retrieve function: a reference the
# registry lacks fails instead of going to the network.
REGISTRY: Registry[Any] = Registry().with_resources(
    [
        ("schema.json", DRAFT7.create_resource(SCHEMA)),
        ("defs.json", DRAFT7.create_resource(DEFS)),
    ]
)
VALIDATOR = Draft7Validator(SCHEMA, registry=REGISTRY)


def _errors(spec: object) -> list[str]:
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in VALIDATOR.iter_errors(spec)
    ]


def _refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def test_the_schema_files_are_draft_7_schemas() -> None:
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    Draft7Validator.check_schema(SCHEMA)
    Draft7Validator.check_schema(DEFS)


@pytest.mark.parametrize(("uri", "document"), [("schema.json", SCHEMA), ("defs.json", DEFS)])
def test_every_reference_resolves_offline(uri: str, document: dict[str, Any]) -> None:
    resolver = REGISTRY.resolver(base_uri=uri)
    refs = sorted(set(_refs(document)))
    assert refs, f"{uri} references nothing: the registry would go untested"
    for ref in refs:
        assert resolver.lookup(ref).contents is not None, ref


def test_a_registry_without_defs_refuses_instead_of_fetching() -> None:
    # The same schema with defs.json left out of the registry: the reference must fail
    # here, not be looked up elsewhere (so the passes below used the vendored defs.json).
    alone = Registry().with_resource("schema.json", DRAFT7.create_resource(SCHEMA))
    validator = Draft7Validator(SCHEMA, registry=alone)
    with pytest.raises(Unresolvable, match=r"defs\.json#/definitions/"):
        validator.validate(claim_spec(UID, CLAIM_DIR, LANES))


def test_the_claim_spec_validates() -> None:
    spec = claim_spec(UID, CLAIM_DIR, LANES)
    assert _errors(spec) == []


def test_the_written_spec_validates_when_read_back(tmp_path: pathlib.Path) -> None:
    written = write_claim_spec(UID, CLAIM_DIR, LANES, cdi_dir=tmp_path / "cdi")
    spec = json.loads(written.read_text())
    assert spec == claim_spec(UID, CLAIM_DIR, LANES)
    assert _errors(spec) == []


def test_the_cdi_version_is_one_the_schema_accepts() -> None:
    # Upstream's schema only types cdiVersion (a string, required); validating the
    # version against that property keeps this right if it ever gains an enum or pattern.
    assert "cdiVersion" in SCHEMA["required"]
    version_schema = SCHEMA["properties"]["cdiVersion"]
    assert Draft7Validator(version_schema).is_valid(CDI_VERSION)
    assert claim_spec(UID, CLAIM_DIR, LANES)["cdiVersion"] == CDI_VERSION


def _drop(*path: str | int) -> Callable[[Spec], None]:
    def mutate(spec: Spec) -> None:
        node: Any = spec
        for step in path[:-1]:
            node = node[step]
        del node[path[-1]]

    return mutate


def _set(value: object, *path: str | int) -> Callable[[Spec], None]:
    def mutate(spec: Spec) -> None:
        node: Any = spec
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value

    return mutate


MOUNT = ("devices", 0, "containerEdits", "mounts", 0)

# (how the spec is broken, the keyword that must refuse it, where the error lies).
BROKEN: list[tuple[str, Callable[[Spec], None], str, tuple[str | int, ...]]] = [
    ("no cdiVersion", _drop("cdiVersion"), "required", ()),
    ("no kind", _drop("kind"), "required", ()),
    ("no devices", _drop("devices"), "required", ()),
    ("cdiVersion not a string", _set(0.5, "cdiVersion"), "type", ("cdiVersion",)),
    ("a device without a name", _drop("devices", 0, "name"), "required", ("devices", 0)),
    (
        "a device without containerEdits",
        _drop("devices", 0, "containerEdits"),
        "required",
        ("devices", 0),
    ),
    # The mount rules live in defs.json: refusing these proves the reference resolved.
    ("a mount without containerPath", _drop(*MOUNT, "containerPath"), "required", MOUNT),
    ("a mount without hostPath", _drop(*MOUNT, "hostPath"), "required", MOUNT),
    ("a mount option not a string", _set(1, *MOUNT, "options", 0), "type", (*MOUNT, "options", 0)),
    (
        "annotations not strings",
        _set({"a": 1}, "devices", 0, "annotations"),
        "type",
        ("devices", 0, "annotations", "a"),
    ),
]


@pytest.mark.parametrize(
    ("mutate", "keyword", "where"),
    [pytest.param(mutate, keyword, where, id=name) for name, mutate, keyword, where in BROKEN],
)
def test_a_broken_spec_is_refused(
    mutate: Callable[[Spec], None], keyword: str, where: tuple[str | int, ...]
) -> None:
    spec = copy.deepcopy(claim_spec(UID, CLAIM_DIR, LANES))
    assert VALIDATOR.is_valid(spec)
    mutate(spec)
    errors = list(VALIDATOR.iter_errors(spec))
    assert errors, "the schema accepted a broken spec"
    assert (keyword, where) in {(e.validator, tuple(e.absolute_path)) for e in errors}, _errors(
        spec
    )
