"""The argv boundary: forms, precedence, negation, JSON values and strict failures."""

from __future__ import annotations

import pathlib

import pytest

from node.flags import (
    FlagError,
    coerce,
    load_flag_table,
    parse_argv,
    render_help,
    unknown_environment,
)

FLAGS = """
[identity]
service = "demo"
[flags.listen]
env = "DEMO_LISTEN"
aliases = ["listen"]
short = "l"
default = "127.0.0.1:1"
help = "where"
[flags.debug]
env = "DEMO_DEBUG"
aliases = ["debug"]
short = "d"
type = "bool"
default = "false"
[flags.verbose]
env = "DEMO_VERBOSE"
aliases = ["verbose"]
short = "v"
type = "bool"
default = "false"
[flags.count]
env = "DEMO_COUNT"
aliases = ["count"]
type = "integer"
default = "3"
[flags.ratio]
env = "DEMO_RATIO"
aliases = ["ratio"]
type = "number"
default = "0.5"
[flags.xids]
env = "DEMO_XIDS"
aliases = ["xids"]
type = "array"
default = "[1, 2]"
[flags.labels]
env = "DEMO_LABELS"
aliases = ["labels"]
type = "map"
default = "{}"
[flags.secret_path]
env = "DEMO_ONLY_ENV"
argv = false
[commands.go.flags.fast]
env = "DEMO_FAST"
aliases = ["fast"]
type = "bool"
default = "false"
"""
COMMANDS = ("go", "stay")


@pytest.fixture
def table(tmp_path: pathlib.Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "flags.toml"
    path.write_text(FLAGS)
    return load_flag_table(path)


def typed(table, argv, env=None):  # type: ignore[no-untyped-def]
    parsed = parse_argv(table, argv, env or {}, COMMANDS)
    return parsed, coerce(table.for_command(parsed.command), parsed.values)


def test_defaults_fill_every_flag(table) -> None:  # type: ignore[no-untyped-def]
    _, values = typed(table, ["go"])
    assert values == {
        "listen": "127.0.0.1:1",
        "debug": False,
        "verbose": False,
        "count": 3,
        "ratio": 0.5,
        "xids": [1, 2],
        "labels": {},
        "fast": False,
    }


@pytest.mark.parametrize(
    "argv",
    [["--listen", "0.0.0.0:9"], ["--listen=0.0.0.0:9"], ["-l", "0.0.0.0:9"], ["-l0.0.0.0:9"]],
)
def test_value_forms(table, argv) -> None:  # type: ignore[no-untyped-def]
    _, values = typed(table, ["go", *argv])
    assert values["listen"] == "0.0.0.0:9"


def test_precedence_argv_over_env_over_default(table) -> None:  # type: ignore[no-untyped-def]
    env = {"DEMO_LISTEN": "10.0.0.1:2", "DEMO_COUNT": "7"}
    parsed, values = typed(table, ["go", "--listen", "10.0.0.9:3"], env)
    assert values["listen"] == "10.0.0.9:3"
    assert values["count"] == 7
    assert parsed.explicit == {"DEMO_LISTEN", "DEMO_COUNT"}


def test_bools_bundles_and_negation(table) -> None:  # type: ignore[no-untyped-def]
    _, values = typed(table, ["go", "-dv", "--fast"], {"DEMO_DEBUG": "true"})
    assert values["debug"] and values["verbose"] and values["fast"]
    _, values = typed(table, ["go", "--no-debug"], {"DEMO_DEBUG": "true"})
    assert values["debug"] is False
    _, values = typed(table, ["go", "--debug=false"])
    assert values["debug"] is False


def test_json_arrays_and_maps(table) -> None:  # type: ignore[no-untyped-def]
    _, values = typed(table, ["go", "--xids", "[79, 48]", "--labels", '{"a": "b"}'])
    assert values["xids"] == [79, 48]
    assert values["labels"] == {"a": "b"}


def test_double_dash_ends_options(table) -> None:  # type: ignore[no-untyped-def]
    parsed, _ = typed(table, ["go", "--count", "4", "--", "sleep", "--listen", "-d"])
    assert parsed.positional == ["sleep", "--listen", "-d"]
    assert parsed.values["DEMO_COUNT"] == "4"


def test_negative_number_is_a_value(table) -> None:  # type: ignore[no-untyped-def]
    _, values = typed(table, ["go", "--count", "-2"])
    assert values["count"] == -2


def test_command_flags_only_after_their_command(table) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FlagError, match="--fast"):
        typed(table, ["stay", "--fast"])


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--nope"], "--nope"),
        (["-x"], "-x"),
        (["--listen"], "--listen: missing value"),
        (["--listen", "--debug"], "--listen: missing value"),
        (["--no-listen"], "--no-listen"),
        (["--debug=maybe"], "--debug"),
        (["--secret-path", "x"], "--secret-path"),
    ],
)
def test_bad_argv_names_the_flag(table, argv, named) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FlagError, match=named):
        typed(table, argv)


def test_typed_errors_are_reported_together(table) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FlagError) as caught:
        typed(table, ["--count", "many", "--ratio", "nan", "--xids", "{}"])
    message = str(caught.value)
    assert "--count" in message and "--ratio" in message and "--xids" in message
    assert "\n" not in message


def test_env_only_flag_reads_environment(table) -> None:  # type: ignore[no-untyped-def]
    parsed, _ = typed(table, [], {"DEMO_ONLY_ENV": "/run/x"})
    assert parsed.values["DEMO_ONLY_ENV"] == "/run/x"


def test_help_lists_every_flag_with_env_type_default(table) -> None:  # type: ignore[no-untyped-def]
    text = render_help(table, "usage: demo", None)
    for spec in table.flags + table.commands["go"]:
        assert spec.env in text
    assert "--no-debug" in text and "[integer, default '3']" in text


def test_malformed_flag_file_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[flags.x]\nenv = "lower-case"\n')
    with pytest.raises(FlagError, match="env"):
        load_flag_table(path)


def test_unknown_environment_names_only_our_misspellings() -> None:
    real = load_flag_table()
    environ = {
        "LITEGRAPH_NODE_LISTEN": "x",  # a global flag
        "LITEGRAPH_NODE_URL": "x",  # a subcommand's flag
        "LITEGRAPH_CAPABILITY_TOKEN": "x",  # not our prefix: a child's variable
        "PATH": "/bin",
        "LITEGRAPH_NODE_STATEDIR": "x",
        "LITEGRAPH_NODE_NOTHING_LIKE_IT": "x",
    }
    assert unknown_environment(real, environ) == [
        "LITEGRAPH_NODE_NOTHING_LIKE_IT is not an option and is ignored (see --help)",
        "LITEGRAPH_NODE_STATEDIR is not an option and is ignored;"
        " did you mean LITEGRAPH_NODE_STATE_DIR?",
    ]


def _with_repeat(tmp_path: pathlib.Path, kind: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "repeat.toml"
    path.write_text(
        f'[commands.go.flags.env]\nenv = "DEMO_ENV"\naliases = ["env"]\ntype = "{kind}"\n'
        'default = "[]"\nrepeat = true\n'
    )
    return load_flag_table(path)


def test_a_repeatable_flag_collects_every_use(tmp_path: pathlib.Path) -> None:
    table = _with_repeat(tmp_path, "array")
    _, values = typed(table, ["go", "--env", "A=1", "--env=B=2 3", "--env", "A=4"])
    assert values == {"env": ["A=1", "B=2 3", "A=4"]}
    # In the environment it is the whole JSON array; argv still wins.
    _, from_env = typed(table, ["go"], {"DEMO_ENV": '["C=5"]'})
    assert from_env == {"env": ["C=5"]}
    _, both = typed(table, ["go", "--env", "D=6"], {"DEMO_ENV": '["C=5"]'})
    assert both == {"env": ["D=6"]}


def test_only_an_array_flag_may_repeat(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FlagError, match="only an array flag can repeat"):
        _with_repeat(tmp_path, "string")


def test_version_is_asked_for_like_help(table) -> None:  # type: ignore[no-untyped-def]
    assert parse_argv(table, ["--version"], {}, COMMANDS).version
    assert not parse_argv(table, ["go", "--", "--version"], {}, COMMANDS).version
