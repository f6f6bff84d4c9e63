"""Checked-in JSON Schemas match the wire types, and drift is caught by file name."""

from __future__ import annotations

import json
import pathlib

import msgspec
import pytest

import node.contracts as schemas
from node.contracts import check_contracts, render_contracts, write_contracts


def test_checked_in_contracts_match_the_types() -> None:
    assert check_contracts() == []


def test_each_file_declares_dialect_and_id() -> None:
    for name, text in render_contracts().items():
        doc = json.loads(text)
        if name == "openapi.json":
            assert doc["openapi"].startswith("3.1")
            continue
        assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert doc["$id"].endswith(name)


def test_drift_is_reported_naming_the_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_contracts(tmp_path)
    assert check_contracts(tmp_path) == []

    class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        error: str
        added_field: int

    monkeypatch.setitem(schemas.PUBLIC_TYPES, "error_envelope", ErrorEnvelope)
    problems = check_contracts(tmp_path)
    assert len(problems) == 1 and "error_envelope.schema.json" in problems[0]


def test_missing_and_stray_files_are_reported(tmp_path: pathlib.Path) -> None:
    write_contracts(tmp_path)
    (tmp_path / "config.schema.json").unlink()
    (tmp_path / "orphan.schema.json").write_text("{}")
    problems = "\n".join(check_contracts(tmp_path))
    assert "config.schema.json: missing" in problems
    assert "orphan.schema.json: no wire type" in problems
