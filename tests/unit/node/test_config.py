"""Typed configuration: one Struct, validated in one place, in step with the flag file."""

from __future__ import annotations

import pathlib
import re

import pytest

from node.cli import COMMANDS, Invocation, _cwd_line, dev_config
from node.config import Config, DeviceMode, build_config, parse_size, split_listen
from node.flags import FlagError, coerce, load_flag_table, parse_argv


def config_from(argv: list[str], env: dict[str, str] | None = None) -> Config:
    table = load_flag_table()
    parsed = parse_argv(table, ["serve", *argv], env or {}, tuple(COMMANDS))
    return build_config(coerce(table.flags, parsed.values))


def test_every_flag_has_a_field_and_every_field_a_flag() -> None:
    table = load_flag_table()
    assert {s.name for s in table.flags} == set(Config.__struct_fields__)
    for spec in table.flags:  # errors name a flag by its first long form
        assert spec.aliases[0] == spec.name.replace("_", "-")


def test_every_env_name_is_prefixed_and_no_secret_is_a_flag() -> None:
    table = load_flag_table()
    specs = table.flags + tuple(s for c in table.commands.values() for s in c)
    for spec in specs:
        assert spec.env.startswith("LITEGRAPH_NODE_"), spec.env
        assert not re.search(r"secret|password|private", spec.name), spec.name


def test_defaults_build_a_valid_config() -> None:
    config = config_from([])
    assert config.listen == "127.0.0.1:7380"
    assert config.devices is DeviceMode.auto
    assert config.reserved_memory == 2**30
    assert 13 not in config.fatal_xids and 79 in config.fatal_xids
    assert config.node_id  # defaults to the host name


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("1024", 1024), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("512mib", 2**29)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "2XB", "1e9"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:80", ("::1", 80)),
        ("localhost:9", ("localhost", 9)),
    ],
)
def test_listen_addresses(listen: str, expected: tuple[str, int]) -> None:
    assert split_listen(listen) == expected


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--listen", "nowhere"], "--listen"),
        (["--listen", "1.2.3.4:99999"], "--listen"),
        (["--listen", "[zz]:1"], "--listen"),
        (["--devices", "tpu"], "--devices"),
        (["--reserved-memory", "lots"], "--reserved-memory"),
        (["--state-min-free", "lots"], "--state-min-free"),
        (["--state-min-free", "-1MiB"], "--state-min-free"),
        (["--token-ttl", "7200"], "--token-ttl"),
        (["--max-queued", "0"], "--max-queued"),
        (["--scheduler-url", "ftp://x"], "--scheduler-url"),
        (["--fatal-xids", '["79"]'], "--fatal-xids"),
        (["--node-id", "../etc"], "--node-id"),
        (["--log-format", "xml"], "--log-format"),
        (["--lane-host-command", '["lanehost"]'], "--lane-host-command"),
        (["--lane-host-command", '["/usr/bin/x", 3]'], "--lane-host-command"),
        (["--guest-writable-roots", '["work"]'], "--guest-writable-roots"),
        (["--guest-writable-roots", '[""]'], "--guest-writable-roots"),
        (["--guest-writable-roots", "[7]"], "--guest-writable-roots"),
        (["--guest-writable-roots", "/srv/work"], "--guest-writable-roots"),
    ],
)
def test_invalid_values_name_the_flag(argv: list[str], named: str) -> None:
    with pytest.raises(FlagError, match=re.escape(named)):
        config_from(argv)


def test_the_lane_host_command_is_the_built_in_one_unless_given() -> None:
    assert config_from([]).lane_host_command == ()
    given = config_from(["--lane-host-command", '["/opt/host", "--fast"]'])
    assert given.lane_host_command == ("/opt/host", "--fast")


def test_guests_write_on_the_host_only_under_roots_given() -> None:
    assert config_from([]).guest_writable_roots == ()  # serve: every cwd read-only
    given = config_from(["--guest-writable-roots", '["/srv/a/", "/srv/b", "/srv/a"]'])
    assert given.guest_writable_roots == ("/srv/a", "/srv/b")


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("/srv/work", "--guest-cwd-roots (LITEGRAPH_NODE_GUEST_CWD_ROOTS): expected a JSON array"),
        (
            '["/srv/a", ',
            "--guest-cwd-roots (LITEGRAPH_NODE_GUEST_CWD_ROOTS): expected a JSON array",
        ),
        ('["work"]', "--guest-cwd-roots: expected a JSON array of absolute paths (got ['work'])"),
        ('["/srv/a", "b/c"]', "--guest-cwd-roots: expected a JSON array of absolute paths"),
        ('[""]', "--guest-cwd-roots: expected a JSON array of absolute paths (got [''])"),
        ("[7]", "--guest-cwd-roots: expected a JSON array of absolute paths (got [7])"),
    ],
)
def test_cwd_roots_are_a_json_array_of_absolute_folders(given: str, said: str) -> None:
    with pytest.raises(FlagError) as refused:
        config_from(["--guest-cwd-roots", given])
    assert str(refused.value).startswith(said), refused.value
    with pytest.raises(FlagError) as from_env:  # the same from the environment
        config_from([], {"LITEGRAPH_NODE_GUEST_CWD_ROOTS": given})
    assert str(from_env.value).startswith(said), from_env.value


def test_serve_lets_no_request_name_a_cwd_unless_roots_are_given() -> None:
    assert config_from([]).guest_cwd_roots == ()  # serve: guests start in their /tmp
    given = config_from(["--guest-cwd-roots", '["/srv/a/", "/srv/b", "/srv/a", "/srv//c/."]'])
    assert given.guest_cwd_roots == ("/srv/a", "/srv/b", "/srv/c")
    env = {"LITEGRAPH_NODE_GUEST_CWD_ROOTS": '["/srv/x"]'}
    assert config_from([], env).guest_cwd_roots == ("/srv/x",)


def dev(argv: list[str], env: dict[str, str]) -> Config:
    """The Config `dev` builds from `argv` and `env`."""
    table = load_flag_table()
    return dev_config(Invocation(table, parse_argv(table, ["dev", *argv], env, tuple(COMMANDS))))


def test_dev_lets_guests_start_where_it_started_unless_told(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    assert dev([], {}).guest_cwd_roots == (str(tmp_path),)
    assert dev(["--guest-cwd-roots", "[]"], {}).guest_cwd_roots == ()
    env = {"LITEGRAPH_NODE_GUEST_CWD_ROOTS": '["/srv/x"]'}
    assert dev([], env).guest_cwd_roots == ("/srv/x",)
    # Each flag has its own default: writable roots given leave the cwd roots dev's.
    told = dev(["--guest-writable-roots", '["/srv/w"]'], {})
    assert (told.guest_cwd_roots, told.guest_writable_roots) == ((str(tmp_path),), ("/srv/w",))
    # dev's banner says where a guest may start, and how to send no cwd.
    assert _cwd_line(dev([], {})).startswith(f"under {tmp_path} (writable); elsewhere refused")
    assert _cwd_line(told) == (
        f"under {tmp_path}, /srv/w (writable); elsewhere refused, `run --cwd none` starts in /tmp"
    )
    assert "`run --cwd none`" in _cwd_line(config_from([]))
    # Guests of their own uids cannot start under pytest's 0700 folder: said so.
    closed = f"{tmp_path} (writable), though a folder above it is closed to guests"
    assert _cwd_line(dev([], {}), own_uids=True).startswith(f"under {closed}")
    assert "closed to guests" not in _cwd_line(config_from(["--guest-cwd-roots", '["/srv"]']), True)


def test_dev_lets_guests_write_where_it_started_unless_told(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    assert dev([], {}).guest_writable_roots == (str(tmp_path),)
    assert dev(["--guest-writable-roots", "[]"], {}).guest_writable_roots == ()
    env = {"LITEGRAPH_NODE_GUEST_WRITABLE_ROOTS": '["/srv/x"]'}
    assert dev([], env).guest_writable_roots == ("/srv/x",)


def test_the_disk_floor_is_256_mib_unless_given_and_0_disables_it() -> None:
    assert config_from([]).state_min_free == 256 * 2**20
    assert config_from(["--state-min-free", "0"]).state_min_free == 0
    env = {"LITEGRAPH_NODE_STATE_MIN_FREE": "1GiB"}
    assert config_from([], env).state_min_free == 2**30


def test_environment_reaches_config() -> None:
    config = config_from([], {"LITEGRAPH_NODE_RESERVED_MEMORY": "2GiB"})
    assert config.reserved_memory == 2 * 2**30


def test_only_dev_gives_guests_the_host_network_they_ask_for_unless_told(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert config_from([]).guest_host_network is False  # serve: every guest has its own
    assert config_from(["--guest-host-network"]).guest_host_network is True
    monkeypatch.chdir(tmp_path)
    table = load_flag_table()

    def dev(argv: list[str]) -> Config:
        return dev_config(Invocation(table, parse_argv(table, ["dev", *argv], {}, tuple(COMMANDS))))

    assert dev([]).guest_host_network is True
    assert dev(["--no-guest-host-network"]).guest_host_network is False


def test_dev_gives_guests_subordinate_uids_unless_told(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    table = load_flag_table()

    def dev(argv: list[str], env: dict[str, str] | None = None) -> Config:
        parsed = parse_argv(table, ["dev", *argv], env or {}, tuple(COMMANDS))
        return dev_config(Invocation(table, parsed))

    assert dev([]).guest_subuids is True
    assert dev(["--no-guest-subuids"]).guest_subuids is False
    assert dev([], {"LITEGRAPH_NODE_GUEST_SUBUIDS": "false"}).guest_subuids is False
