"""A guest's environment: what it inherits from the daemon, what its request may
not set, and the environment it is finally given. The lane hosts
(`supervisor.lane_host_process`) inherit by the same allow list."""

from __future__ import annotations

from collections.abc import Mapping

from supervisor.process_spec import ProcessSpec

__all__ = [
    "DEVICE_ENV_NAMES",
    "ENV_ALLOW_LIST",
    "GUEST_DEFAULT_ENV",
    "GUEST_PATH",
    "RESERVED_ENV_NAMES",
    "RESERVED_ENV_PREFIXES",
    "build_environment",
    "is_reserved_env_name",
]

# What a child inherits from the daemon's own environment; nothing else leaks.
ENV_ALLOW_LIST = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TERM",
    "USER",
    "LOGNAME",
    "TMPDIR",
)
# Set by the supervisor, or able to change what runs (the loader, an interpreter's
# start-up, a shell's init file) or which devices a runtime uses. Compared in
# upper case: several runtimes read these names case-insensitively.
RESERVED_ENV_NAMES = frozenset(
    {
        "BASH_ENV",
        "BASHOPTS",
        "ENV",
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "GPU_DEVICE_ORDINAL",
        "HOSTALIASES",
        "IFS",
        "JAVA_TOOL_OPTIONS",
        "_JAVA_OPTIONS",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_CHECK_",
        "MALLOC_TRACE",
        "NLSPATH",
        "NODE_OPTIONS",
        "OPENSSL_CONF",
        "PERL5LIB",
        "PERL5OPT",
        "PERLLIB",
        "PS4",
        "RES_OPTIONS",
        "RESOLV_HOST_CONF",
        "RUBYLIB",
        "RUBYOPT",
        "SHELLOPTS",
        "TMPDIR",
    }
)
RESERVED_ENV_PREFIXES = (
    "LITEGRAPH_",
    "LD_",  # LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH, ...
    "DYLD_",
    "PYTHON",  # PYTHONPATH, PYTHONSTARTUP, PYTHONHOME, ...
    "CUDA_",  # CUDA_VISIBLE_DEVICES, CUDA_MPS_PIPE_DIRECTORY, ...
    "NVIDIA_",
    "HIP_",
    "ROCR_",
    "HSA_",
)
DEVICE_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
# A guest's PATH: the system's folders (what its sandbox shows), never the daemon's
# own PATH (root's home tool folders, a venv), which the lane hosts still inherit.
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Set for every guest unless its request sets them (so these few are not reserved):
# the fixed PATH, over the daemon's; Python writes each line as it is printed, so
# followers of the logs see it live.
GUEST_DEFAULT_ENV = {"PATH": GUEST_PATH, "PYTHONUNBUFFERED": "1"}


def is_reserved_env_name(name: str) -> bool:
    upper = name.upper()
    if name in GUEST_DEFAULT_ENV:
        return False
    return upper in RESERVED_ENV_NAMES or upper.startswith(RESERVED_ENV_PREFIXES)


def build_environment(spec: ProcessSpec, parent_env: Mapping[str, str]) -> dict[str, str]:
    """Allow-listed daemon variables < guest defaults (PATH among them) < the
    invocation's env < supervisor variables."""
    env = {name: parent_env[name] for name in ENV_ALLOW_LIST if name in parent_env}
    env.update(GUEST_DEFAULT_ENV)
    env.update(spec.env)
    env.update(spec.extra_env)
    # Last, so nothing above can widen the device set; "" hides every GPU.
    devices = ",".join(spec.visible_devices)
    for name in DEVICE_ENV_NAMES:
        env[name] = devices
    return env
