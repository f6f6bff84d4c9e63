"""Pins the architecture: import direction, where packages load from, public names."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("node", "capabilities", "supervisor", "api")
# What each package may import of the others (DESIGN.md, "Imports point one way").
ALLOWED = {
    "capabilities": set(),
    "node": set(),
    "supervisor": {"node", "capabilities"},
    "api": {"node", "capabilities", "supervisor"},
}
# Only these modules wire everything together.
COMPOSITION_ROOTS = {"node/daemon.py", "node/cli.py", "node/__main__.py"}

PUBLIC_NAMES: dict[str, set[str]] = {
    "node": {
        "Config",
        "FlagError",
        "Ledger",
        "Machine",
        "NodeSnapshot",
        "Readiness",
        "ReservationRefused",
        "build_config",
    },
    "capabilities": {
        "DEADLINE_MARGIN",
        "DEFAULT_LEEWAY",
        "MAX_LEEWAY",
        "MAX_TOKEN_CHARS",
        "MAX_TTL_SECONDS",
        "CapabilityError",
        "Claims",
        "DenyList",
        "Footer",
        "Isolation",
        "KeyFileError",
        "KeyFileProblem",
        "KeyRing",
        "KeyRingError",
        "LaneOp",
        "LaneValidator",
        "MintError",
        "MintedToken",
        "RevocationFull",
        "TokenRefusal",
        "TokenRefused",
        "TokenService",
    },
    "supervisor": {
        "AdmissionRefused",
        "InvocationRequest",
        "InvocationState",
        "InvocationStatus",
        "LaneWorkError",
        "NodeEvent",
        "SubmitResponse",
        "Supervisor",
        "UnknownInvocation",
    },
    "api": {"ApiError", "ErrorEnvelope", "create_app"},
}


def _imported_packages(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in COMPOSITION_ROOTS:
            continue
        wrong = _imported_packages(path) - ALLOWED[package] - {package}
        assert not wrong, f"{relative} imports {sorted(wrong)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_load_from_the_checkout(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__file__ is not None
    assert pathlib.Path(module.__file__).resolve() == ROOT / package / "__init__.py"


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == PUBLIC_NAMES[package]
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_threat_model_folder_is_not_importable() -> None:
    assert not (ROOT / "threat-model" / "__init__.py").exists()
