"""Pins the capabilities package: its public names, its imports, its wire vocabulary."""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import msgspec
import pytest

import capabilities
from capabilities import errors

PACKAGE = pathlib.Path(capabilities.__file__).resolve().parent
ALLOWED_THIRD_PARTY = {"cryptography", "msgspec"}

OURS = (
    "claims",
    "errors",
    "keyring",
    "paseto",
    "publication",
    "revocation",
    "service",
    "validator",
)

WIRE_STRUCTS = (
    capabilities.Claims,
    capabilities.Footer,
    capabilities.MintedToken,
    capabilities.KeySet,
    capabilities.PublishedKey,
    capabilities.Introspection,
)


def _top_level_imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_capabilities_imports_only_stdlib_cryptography_and_msgspec() -> None:
    for name in OURS:
        path = PACKAGE / f"{name}.py"
        outside = _top_level_imports(path) - set(sys.stdlib_module_names) - {"capabilities"}
        assert outside <= ALLOWED_THIRD_PARTY, f"{path.name} imports {sorted(outside)}"
        assert "trio" not in outside


def test_modules_stay_small() -> None:
    for name in OURS:
        lines = len((PACKAGE / f"{name}.py").read_text().splitlines())
        assert lines <= 400, f"{name}.py has {lines} lines"


def test_every_exception_is_a_capability_error_and_drawn_in_the_tree() -> None:
    doc = errors.__doc__ or ""
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, errors.CapabilityError)
            assert name in doc, f"{name} missing from the exception tree"


def test_wire_values_are_snake_case() -> None:
    snake = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
    for enum_type in (
        capabilities.TokenRefusal,
        capabilities.KeyFileProblem,
        capabilities.LaneOp,
        capabilities.Isolation,
        capabilities.KeyStatus,
    ):
        for member in enum_type:
            assert snake.match(member.value), member
    for struct in WIRE_STRUCTS:
        for field in struct.__struct_fields__:
            assert snake.match(field), field


def test_scope_vocabulary() -> None:
    assert [op.value for op in capabilities.LaneOp] == [
        "memory_reserve",
        "memory_release",
        "execute",
        "memory_write",
        "memory_read",
    ]
    assert [i.value for i in capabilities.Isolation] == [
        "shared",
        "sandbox",
        "partitioned",
        "dedicated",
    ]


def test_wire_types_are_strict_frozen_structs() -> None:
    for struct in WIRE_STRUCTS:
        config = struct.__struct_config__
        assert isinstance(config, msgspec.structs.StructConfig)
        assert config.frozen and config.forbid_unknown_fields
        with pytest.raises(TypeError):  # keyword-only: no positional arguments
            struct("positional")


def test_claims_field_names_are_the_registered_ones() -> None:
    assert capabilities.Claims.__struct_fields__ == (
        "iss",
        "sub",
        "aud",
        "iat",
        "nbf",
        "exp",
        "jti",
        "ops",
        "vram_bytes",
        "isolation",
    )
