"""Pins the architecture: import direction, where packages load from, public names."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The floors, bottom up (docs/architecture.md): each top-level package is on one floor,
# and a module imports only its own package and packages of the floors below it.
FLOORS: tuple[tuple[str, ...], ...] = (
    # The bottom floor: packages that import nothing of each other. "lanehost" is the
    # lane host process, "capabilities" the tokens, "machine" the machine model,
    # "kubeplugin" the Kubernetes DRA kubelet plugin's sockets.
    ("lanehost", "capabilities", "machine", "kubeplugin"),
    ("supervisor",),
    ("api",),
    # The application (CLI, flags, config, daemon wiring): it may import every floor.
    ("node",),
)
PACKAGES = tuple(package for floor in FLOORS for package in floor)
FLOOR_OF = {package: level for level, floor in enumerate(FLOORS) for package in floor}
# What each package may import of the others: only lower floors, and not all of them.
ALLOWED = {
    "lanehost": set(),
    "machine": set(),
    "capabilities": set(),
    "kubeplugin": set(),
    "supervisor": {"lanehost", "machine", "capabilities"},
    "api": {"machine", "capabilities", "supervisor"},
    "node": {"lanehost", "machine", "capabilities", "kubeplugin", "supervisor", "api"},
}
# The modules of the project, by dotted name, found from the files in the checkout.
MODULES = {
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
    for package in PACKAGES
    for path in sorted((ROOT / package).rglob("*.py"))
}


def layer_of(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in PACKAGES else None


def _imports(module: str) -> set[str]:
    """The project modules `module` imports, lazy and type-only imports included."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
    return {name for name in found if name in MODULES}


GRAPH = {module: _imports(module) for module in MODULES}


def test_the_top_level_folders_are_the_floors() -> None:
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(PACKAGES)
    assert not (ROOT / "node" / "machine").exists()
    assert {layer_of(m) for m in MODULES} == set(PACKAGES)


def test_each_package_may_import_only_floors_below_its_own() -> None:
    for package, allowed in ALLOWED.items():
        higher = {name for name in allowed if FLOOR_OF[name] >= FLOOR_OF[package]}
        assert not higher, f"{package} may import {sorted(higher)} on its floor or above"
    assert ALLOWED["node"] == set(PACKAGES) - {"node"}


@pytest.mark.parametrize("layer", PACKAGES)
def test_imports_point_one_way(layer: str) -> None:
    for module, imported in GRAPH.items():
        if layer_of(module) != layer:
            continue
        wrong = {layer_of(name) for name in imported} - ALLOWED[layer] - {layer}
        assert not wrong, f"{module} imports {sorted(str(w) for w in wrong)}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports as a path that ends where it starts, or None."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        stack.append(module)
        for name in sorted(graph.get(module, set())):
            if name in stack:
                return [*stack[stack.index(name) :], name]
            if name not in done and (cycle := visit(name)):
                return cycle
        stack.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return None


def test_no_import_cycles_between_modules() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


PUBLIC_NAMES: dict[str, set[str]] = {
    "node": {"Config", "FlagError", "build_config"},
    "machine": {
        "Ledger",
        "Machine",
        "NodeSnapshot",
        "Readiness",
        "ReservationRefused",
        "snapshot_once",
    },
    "capabilities": {
        "DEADLINE_MARGIN",
        "DEFAULT_LEEWAY",
        "MAX_LEEWAY",
        "MAX_TOKEN_CHARS",
        "MAX_TTL_SECONDS",
        "CapabilityError",
        "Claims",
        "Footer",
        "Introspection",
        "Isolation",
        "KeyFileError",
        "KeyFileProblem",
        "KeyRing",
        "KeyRingError",
        "KeySet",
        "KeyStatus",
        "LaneOp",
        "LaneValidator",
        "LiveTokens",
        "MintError",
        "MintedToken",
        "PublishedKey",
        "RefreshTooEarly",
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
    "lanehost": {
        "MAX_DATA_BYTES",
        "MAX_FRAME_BYTES",
        "PROTOCOL_VERSION",
        "Kernel",
        "KernelError",
        "load_kernels",
    },
}


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_load_from_the_checkout(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__file__ is not None
    assert pathlib.Path(module.__file__).resolve() == ROOT / package / "__init__.py"


@pytest.mark.parametrize("package", sorted(PUBLIC_NAMES))
def test_public_names(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == PUBLIC_NAMES[package]
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_threat_model_folder_is_not_importable() -> None:
    assert not (ROOT / "threat-model" / "__init__.py").exists()
