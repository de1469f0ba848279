"""The config: defaults, round trips, one table of bad configs, overrides, reference, reload diff, paths."""
from __future__ import annotations

import dataclasses
import pickle
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingestd.errors import ConfigError
from ingestd.service.config import (
    DEFAULT_TOML, LIVE_KEYS, Config, FrozenTable, ResolvedPaths, check_file, config_from_dict, config_to_toml,
    default_control_address, load_config, reference, reloadable_diff, resolve_paths, with_overrides,
)
from ingestd.service.config_schema import SECTIONS

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ALL_KEYS = [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ingestd.toml"
    path.write_text(text, encoding="utf-8")
    return path


# -- defaults and round trips -----------------------------------------------------------
def test_default_is_the_dataclass_defaults():
    config = load_config()
    assert config == Config()
    assert (config.workers.env, config.workers.policy, config.workers.count) == ("CartPole", "MLP", 2)
    assert config.metrics.address == "127.0.0.1" and config.control.address == ""


def test_default_toml_resumes_weights_and_says_how_to_start_fresh():
    assert load_config().service.start_weights == "resume"
    prose = " ".join(line.lstrip("# ") for line in DEFAULT_TOML.splitlines())
    assert 'start_weights = "resume"' in DEFAULT_TOML and '"initial" publishes the policy\'s initial weights' in prose


def test_default_toml_lists_every_key_with_a_comment():
    lines = DEFAULT_TOML.splitlines()
    for key in ALL_KEYS:
        name = key.split(".")[1]
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{name} = "))
        assert lines[index - 1].startswith("# "), key


def test_effective_config_round_trips(tmp_path):
    config = load_config(overrides=[
        "workers.count=4", "workers.env=checksum", 'workers.env_kwargs={max_steps=10, name="a \\"q\\"\\n", x=[1.5, 2]}',
        "workers.policy=my.pkg:make", "service.log_level=DEBUG", "service.data_dir=~/d", "metrics.enabled=false",
        "control.address=tcp://*:5555", "control.curve_secret_key=/k/server.key", "control.curve_authorized_keys=/k/ok",
        "workers.policy_kwargs.layers.sizes=[64, 64]", "replay.capacity=123456",
    ])
    text = config_to_toml(config)
    assert "# (default: 2)" in text
    again = check_file(write(tmp_path, text))
    assert again == config
    assert config_from_dict(config.to_dict()) == config
    assert config.workers.env == "Checksum" and config.service.log_level == "debug"  # canonical spelling


def test_config_is_frozen_hashable_and_picklable():
    config = load_config(overrides=["workers.env_kwargs={a={b=[1, 2]}}"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.workers.count = 3  # type: ignore[misc]
    kwargs = config.workers.env_kwargs
    assert isinstance(kwargs, FrozenTable) and kwargs["a"]["b"] == (1, 2)
    with pytest.raises(TypeError):
        kwargs["a"] = 1  # type: ignore[index]
    assert pickle.loads(pickle.dumps(config)) == config and hash(config) == hash(pickle.loads(pickle.dumps(config)))
    assert dict(**kwargs) == {"a": kwargs["a"]} and config.to_dict()["workers"]["env_kwargs"] == {"a": {"b": [1, 2]}}


toml_scalars = st.one_of(st.integers(-(2**63), 2**63 - 1), st.booleans(), st.text(max_size=12),
                         st.floats(allow_nan=False))
toml_values = st.recursive(toml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=8), toml_values, max_size=4))
def test_any_kwargs_table_round_trips_through_toml(table):
    config = config_from_dict({"workers": {"env_kwargs": table}})
    assert config_from_dict(tomllib.loads(config_to_toml(config))) == config
    assert config.to_dict()["workers"]["env_kwargs"] == table


# -- the table of bad configs -------------------------------------------------------------
# (TOML text or [overrides], the key the error must name, a phrase the message must contain)
BAD = [
    ("[workers]\ncount = 300\n", "workers.count", "0..256"),
    ("[workers]\ncount = true\n", "workers.count", "(a boolean)"),
    ("[workers]\ncount = 2.0\n", "workers.count", "without a decimal point"),
    (["workers.count='4'"], "workers.count", "without quotes"),
    ("[workers]\ncout = 3\n", "workers.cout", "did you mean 'workers.count'"),
    ("[worker]\ncount = 3\n", "worker", "did you mean 'workers'"),
    ("[service]\ncount = 3\n", "service.count", "belongs in [workers]"),
    ("count = 3\n", "count", "workers.count"),
    ("workers = 3\n", "workers", "must be a table"),
    (["service.log_level=verbose"], "service.log_level", "debug, info, warning, error"),
    (["workers.env=cartpol"], "workers.env", "did you mean 'CartPole'"),
    (["workers.env=mypkg.envs"], "workers.env", "after a colon: 'mypkg:envs' or 'mypkg.envs:make'"),
    # a class named with a dot: the class goes after the colon (it suggested 'goalenvs.reach.Reach:make')
    (["workers.env=goalenvs.reach.Reach"], "workers.env", "after a colon: 'goalenvs.reach:Reach'"),
    (["workers.policy=my-policy"], "workers.policy", "import path"),
    (["workers.policy=Randum"], "workers.policy", "one of Random, MLP"),  # a bare name failed at startup, not here
    (["workers.env_kwargs=3"], "workers.env_kwargs", "a table"),
    (["workers.num_envs=0"], "workers.num_envs", "1.."),
    (["workers.chunk_steps=-1"], "workers.chunk_steps", "1.."),
    (["workers.threads=-1"], "workers.threads", "0..1024"),
    (["workers.device=CUDA 0"], "workers.device", "torch device"),
    (["workers.restart_budget=0"], "workers.restart_budget", "1.."),
    (["workers.heartbeat_timeout_s=0"], "workers.heartbeat_timeout_s", "> 0"),
    (["workers.restart_backoff_max_s=0.05"], "workers.restart_backoff_max_s", "workers.restart_backoff_s"),
    (["replay.capacity=1000"], "replay.capacity", "at least 16384"),
    (["workers.count=256", "workers.num_envs=1024"], "replay.capacity", "at least 33554432"),
    (["replay.capacity=0"], "replay.capacity", "1.."),
    (["replay.path=relative/dir"], "replay.path", "absolute path"),
    (["service.data_dir=3"], "service.data_dir", "absolute path"),
    (["service.stop_timeout_s=inf"], "service.stop_timeout_s", "finite number > 0"),
    # config review: passed every check, then the shutdown died of OverflowError (exit 1, sockets left)
    (["service.stop_timeout_s=1e10"], "service.stop_timeout_s", "and <= 1e+06 (seconds)"),
    (["control.ack_timeout_s=1e10"], "control.ack_timeout_s", "and <= 1e+06 (seconds)"),
    (["workers.heartbeat_timeout_s=1e308"], "workers.heartbeat_timeout_s", "and <= 1e+06 (seconds)"),
    (["service.stop_timeout_s='10'"], "service.stop_timeout_s", "without quotes"),
    (["service.seed=-1"], "service.seed", "expected an integer in 0..9223372036854775807"),
    (["metrics.episode_return_buckets=[0, 10, 10]"], "metrics.episode_return_buckets", "the numbers must increase"),
    (["metrics.episode_return_buckets=[0, 'a']"], "metrics.episode_return_buckets[1]", "finite number"),
    (["metrics.episode_return_buckets=[0, inf]"], "metrics.episode_return_buckets[1]", "finite number"),
    (["metrics.episode_return_buckets=100"], "metrics.episode_return_buckets", "an array of at most 200"),
    # diff review: distinct integers past 2**53 became equal floats (exit 1 at the exporter's start)
    (["metrics.episode_return_buckets=[9007199254740992, 9007199254740993]"], "metrics.episode_return_buckets",
     "must increase"),
    # and an integer past float's range made math.isfinite raise OverflowError (a traceback, not 78)
    # (TOML's integers are 64-bit: longer ones are refused as they are read, naming the key)
    (["metrics.episode_return_buckets=[1" + "0" * 400 + "]"], "metrics.episode_return_buckets[0]", "64-bit range"),
    (["service.stop_timeout_s=1" + "0" * 400], "service.stop_timeout_s", "64-bit range"),
    (["service.start_weights=fresh"], "service.start_weights", "one of resume, initial"),
    (["control.address=tcp://0.0.0.0:5555"], "control.address", "ingestctl keygen"),
    (["control.events_address=tcp://0.0.0.0:5556"], "control.events_address", "control.curve_secret_key"),
    (["control.curve_secret_key=/etc/ingestd/server.key"], "control.curve_authorized_keys", "both"),
    (["control.address=ipc://relative.sock"], "control.address", "ipc:///absolute/path"),
    (["control.address=tcp://host:99999"], "control.address", "tcp://host:port"),
    (["control.address=ipc:///" + "x" * 120], "control.address", "107"),
    (["control.address=ipc:///s", "control.events_address=ipc:///s"], "control.events_address", "differ"),
    # the daemon's own listeners on one socket: the second bind failed after the replay was made (ops review)
    (["control.address=ipc:///d/c.sock", "control.events_address=ipc:///d//c.sock"], "control.events_address",
     "binds the socket control.address"),
    (["control.address=tcp://localhost:5555", "control.events_address=tcp://127.0.0.1:5555",
      "control.curve_secret_key=/k/s.key", "control.curve_authorized_keys=/k/ok"], "control.events_address",
     "binds the socket control.address"),
    (["control.address=tcp://127.0.0.1:19777", "metrics.port=19777", "control.curve_secret_key=/k/s.key",
      "control.curve_authorized_keys=/k/ok"], "metrics.port", "is the port of control.address"),
    (["control.events_address=tcp://0.0.0.0:19778", "metrics.port=19778", "control.curve_secret_key=/k/s.key",
      "control.curve_authorized_keys=/k/ok"], "metrics.port", "is the port of control.events_address"),
    (["control.max_frames=1"], "control.max_frames", "2..1024"),
    (["control.max_message_bytes=1.5e9"], "control.max_message_bytes", "an integer"),
    # a min_size never reached held every trainer for ever (review: a frame budget below it, accepted at start)
    (["limiter.enabled=true", "limiter.min_size=50000", "workers.total_frames=40000"], "limiter.min_size",
     "at most workers.total_frames (40000)"),
    (["metrics.port=70000"], "metrics.port", "0..65535"),
    (["metrics.enabled=yes"], "metrics.enabled", "true or false"),
    (["metrics.address="], "metrics.address", "host name or IP"),
    (["nonsense"], "nonsense", "section.key=value"),
    (["workers.count.x=1"], "workers.count", "not a table"),
    ("[workers\ncount = 3\n", "ingestd.toml", "line 1"),
    ("[workers]\ncount = \n", "ingestd.toml", "2 | count ="),
]


@pytest.mark.parametrize("source, key, phrase", BAD, ids=[f"{i}-{case[1]}" for i, case in enumerate(BAD)])
def test_bad_config_names_the_key(tmp_path, source, key, phrase):
    with pytest.raises(ConfigError) as info:
        if isinstance(source, list):
            load_config(overrides=source)
        else:
            load_config(write(tmp_path, source))
    assert info.value.key.endswith(key), str(info.value)
    assert key in str(info.value) and phrase in str(info.value), str(info.value)


@pytest.mark.parametrize("section, key, value, named", [
    ("metrics", "episode_return_buckets", [10**400], "metrics.episode_return_buckets[0]"),
    ("service", "stop_timeout_s", 10**400, "service.stop_timeout_s"),
])
def test_an_integer_past_floats_range_from_python_is_refused_naming_the_key(section, key, value, named):
    """``config_from_dict`` takes Python values, which no 64-bit rule of TOML bounds: an int past
    float's range is refused as not finite (it raised OverflowError in math.isfinite)."""
    with pytest.raises(ConfigError) as info:
        config_from_dict({section: {key: value}})
    assert info.value.key == named and "finite number" in str(info.value), str(info.value)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(missing)
    assert info.value.key == str(missing)
    assert str(info.value).startswith(f"{missing}: config file not found"), str(info.value)


@pytest.mark.parametrize("text, message", [
    ("[workers\ncount = 3\n", "TOML syntax error at line 1, column 9: Expected ']' at the end of a table "
                               "declaration\n  1 | [workers\n    |         ^"),
    ("[workers]\ncount = \n", "TOML syntax error at line 2, column 9: Invalid value\n  2 | count = \n"
                               "    |         ^"),
    ('[service]\nlog_level = "info\n', "TOML syntax error at line 2, column 18: Illegal character"),
    ('log_level = "info', "TOML syntax error at the end of the file: Unterminated string"),
    ("# a\u2028b\n[workers]\ncount = \n", "TOML syntax error at line 3, column 9: Invalid value\n  3 | count = \n"),
], ids=["unclosed table", "missing value", "string not closed on its line", "string not closed at the end",
        "a line separator inside a comment"])
def test_toml_syntax_error_names_the_file_line_and_column(tmp_path, text, message):
    """A file that is not TOML is not a bad key: the message starts with the file, says it is a
    TOML syntax error and where, and quotes the line with the column marked."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)
    assert "config key" not in str(info.value) and info.value.key == str(path)


@pytest.mark.parametrize("value, said", [
    ("9" * 5000, "an integer outside TOML's 64-bit range"),
    ("0x" + "f" * 4000, "an integer outside TOML's 64-bit range"),  # (no digit limit in base 16: str() raised)
    (str(2**63), "an integer outside TOML's 64-bit range"),
    ("[" * 50_000 + "]" * 50_000, "arrays or inline tables nested more than 32 levels deep"),
    ("[" * 400 + "]" * 400, "arrays or inline tables nested more than 32 levels deep"),  # (read, then a
    # RecursionError in the messages: diff review)
], ids=["an integer of 5000 digits", "a hex integer of 4000 digits", "2**63", "arrays nested 50000 deep",
        "arrays nested 400 deep"])
def test_toml_python_cannot_read_is_a_config_error_in_a_file_and_a_set(tmp_path, value, said):
    """Chaos review: such a file, or such a --set, ended ``config check``, ``run`` and a reload in a
    ValueError or RecursionError traceback (exit 1, which systemd retries for ever)."""
    path = write(tmp_path, f"[workers]\ncount = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    # named by the key where Python read the value, else by the file (its parser gave up first)
    assert said in str(info.value), str(info.value)[:300]
    assert info.value.key.startswith("workers.count") or str(info.value).startswith(f"{path}: {said}"), \
        str(info.value)[:300]
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"workers.count={value}"])
    assert info.value.key.startswith("workers.count") and said in str(info.value), str(info.value)[:300]


@pytest.mark.parametrize("text, key", [
    ("[service]\nseed = 9223372036854775808\n", "service.seed"),
    ("[workers]\nenv_kwargs = {a = [1, 0x1" + "0" * 20 + "]}\n", "workers.env_kwargs.a[1]"),
    ("[workers]\nenv_kwargs = {a = " + "[" * 31 + "]" * 31 + "}\n", "workers.env_kwargs.a" + "[0]" * 30),
])
def test_a_value_past_what_toml_allows_in_a_file_names_its_key(tmp_path, text, key):
    """Diff review: a 64-bit overflow in a file named only the file, where the key was named
    before; nesting counts from the file's root, as for --set of the same key."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.key == key, str(info.value)
    value = text.split("= ", 1)[1].strip()
    name = "workers.env_kwargs" if "env_kwargs" in text else "service.seed"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{name}={value}"])
    assert info.value.key == key, str(info.value)


def test_toml_at_the_limits_is_read(tmp_path):
    """The extremes TOML allows still load: the 64-bit integers and 32 levels of nesting."""
    path = write(tmp_path, f"[service]\nseed = {2**63 - 1}\n[workers]\nenv_kwargs = {{a = {'[' * 30}{']' * 30}}}\n")
    config = load_config(path)
    assert config.service.seed == 2**63 - 1
    assert load_config(overrides=[f"workers.env_kwargs={{low={-2**63}}}"]).workers.env_kwargs["low"] == -2**63


def test_every_problem_is_reported_at_once_and_cross_checks_wait_for_the_keys(tmp_path):
    """A config with four problems names all four, in the file's order, not just the first;
    the check across keys (capacity against workers) runs only once every key is right."""
    path = write(tmp_path, '[workers]\ncount = -3\nchunk_stepz = 4\n[replay]\ncapacity = "big"\n[metrix]\nx = 1\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    keys = [e.key for e in info.value.errors]
    assert keys == ["workers.count", "workers.chunk_stepz", "replay.capacity", "metrix"], str(info.value)
    assert info.value.key == "workers.count" and str(info.value).count("\n") == 3
    assert "did you mean 'workers.chunk_steps'" in str(info.value)
    with pytest.raises(ConfigError) as info:  # the keys right, the cross-key check still runs
        load_config(overrides=["replay.capacity=10"])
    assert [e.key for e in info.value.errors] == ["replay.capacity"] and "must be at least" in str(info.value)
    with pytest.raises(ConfigError) as info:  # a bad key: no cross-key error judged on its default
        load_config(overrides=["replay.capacity=10", "workers.count=x"])
    assert [e.key for e in info.value.errors] == ["workers.count"], str(info.value)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        config_from_dict({"workers": {"count": -1}})


# -- overrides ----------------------------------------------------------------------------------
@pytest.mark.parametrize("override, section, key, expected", [
    ("workers.count=4", "workers", "count", 4),
    ("workers.env=Checksum", "workers", "env", "Checksum"),
    ("workers.env = pkg.mod:make_env ", "workers", "env", "pkg.mod:make_env"),
    ("workers.env_kwargs={max_steps=10}", "workers", "env_kwargs", {"max_steps": 10}),
    ("workers.env_kwargs.id=CartPole-v1", "workers", "env_kwargs", {"id": "CartPole-v1"}),
    ("workers.device=cuda:1", "workers", "device", "cuda:1"),
    ("service.stop_timeout_s=3", "service", "stop_timeout_s", 3.0),
    ("metrics.enabled=false", "metrics", "enabled", False),
    ("metrics.address=0.0.0.0", "metrics", "address", "0.0.0.0"),
    ("control.address=ipc:///run/x.sock", "control", "address", "ipc:///run/x.sock"),
    ('service.data_dir="/var/lib/a b"', "service", "data_dir", "/var/lib/a b"),
    ("control.address=", "control", "address", ""),
    ("service.start_weights=initial", "service", "start_weights", "initial"),
    ("service.start_weights=Resume", "service", "start_weights", "resume"),
])
def test_override_parses(override, section, key, expected):
    value = getattr(getattr(load_config(overrides=[override]), section), key)
    assert value == expected
    assert type(value) is type(expected) or isinstance(value, FrozenTable)


# `ingestd run` / `ingestd config check` --set: (argv after the command, exit status, text on stderr).
# A --set that is not section.key=value is a bad argument (64, as README says); a well-formed one
# whose key or value is wrong is a config error (78).
SET_CASES = [
    (["--set", "workers.count"], 64, "argument --set: an override is section.key=value"),
    (["--set", "=4"], 64, "got '=4'"),
    (["--set", "workers.=4"], 64, "got 'workers.=4'"),
    (["--set", ".count=4"], 64, "got '.count=4'"),
    (["--set", "count=4"], 64, "did you mean workers.count=4?"),
    (["--set", "workers.count=4", "--set", "workers.count"], 64, "got 'workers.count'"),
    (["--set", "workers.count=x"], 78, "config key 'workers.count': expected an integer"),
    (["--set", "workers.cout=4"], 78, "did you mean 'workers.count'"),
    (["--set", "service.start_weights=latest"], 78, "config key 'service.start_weights': expected one of resume, "
                                                     "initial"),
    (["--set", "workers.count.x=1"], 78, "config key 'workers.count'"),
    # above the real bound, which the reference leaves out: the error must name it, not say ">= 0"
    (["--set", "limiter.min_size=9223372036854775807"], 78, "config key 'limiter.min_size': expected an integer "
                                                            "in 0..4611686018427387904, got 9223372036854775807"),
]


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("args, status, phrase", SET_CASES, ids=[" ".join(case[0]) for case in SET_CASES])
def test_malformed_set_is_a_usage_error_a_bad_value_a_config_error(tmp_path, capsys, command, args, status, phrase):
    """Every case fails before anything starts (``run`` included), so ``main`` runs in-process."""
    from ingestd.service.cli import main

    argv = ["run", *args] if command == "run" else ["config", "check", str(write(tmp_path, "")), *args]
    try:
        got = main(argv)
    except SystemExit as exc:  # argparse's way out
        got = exc.code
    stderr = capsys.readouterr().err
    assert got == status and phrase in stderr, stderr


def test_config_check_refuses_a_device_this_host_lacks(tmp_path, capsys):
    """`run` refuses it with 78, so `check` (step 3 of docs/systemd.md) must not say ok."""
    from ingestd.service.cli import main

    path = write(tmp_path, '[workers]\ndevice = "tpu"\n')
    assert main(["config", "check", str(path)]) == 78
    assert "config key 'workers.device': 'tpu' is not a torch device" in capsys.readouterr().err


def test_config_check_builds_the_env_and_policy_as_run_does(tmp_path, capsys):
    """An env and policy that cannot work together passed `check` and failed `run` with 78."""
    from ingestd.service.cli import main

    path = write(tmp_path, '[workers]\nenv = "Gym"\nenv_kwargs = { id = "Pendulum-v1" }\n')
    assert main(["config", "check", str(path)]) == 78
    err = capsys.readouterr().err
    assert "config key 'workers.policy': the MLP policy needs a discrete action space" in err
    assert "package.module:factory" in err  # what to do about it


def test_overrides_apply_on_top_of_a_file_in_order(tmp_path):
    path = write(tmp_path, "[workers]\ncount = 1\nenv_kwargs = { a = 1 }\n")
    config = load_config(path, ["workers.count=3", "workers.env_kwargs.b=2", "workers.count=5"])
    assert config.workers.count == 5 and config.workers.env_kwargs == {"a": 1, "b": 2}
    with pytest.raises(TypeError):
        load_config(path, "workers.count=3")  # type: ignore[arg-type]


def test_with_overrides_rechecks():
    config = with_overrides(Config(), ["workers.count=8"])
    assert config.workers.count == 8 and config.service == Config().service
    with pytest.raises(ConfigError, match="replay.capacity"):
        with_overrides(config, ["workers.num_envs=1000000"])


# -- reference and reload ------------------------------------------------------------------------
def test_reference_covers_every_field_with_a_doc():
    rows = reference()
    assert [key for key, _, _ in rows] == ALL_KEYS
    assert all(doc and "Accepts" in doc for _, _, doc in rows)
    defaults = dict((key, default) for key, default, _ in rows)
    assert defaults["workers.env"] == '"CartPole"' and defaults["workers.count"] == "2"
    assert defaults["control.max_message_bytes"] == str(256 << 20) and defaults["workers.env_kwargs"] == "{}"


@pytest.mark.parametrize("overrides, live, restart", [
    ([], [], []),
    (["workers.count=5"], ["workers.count"], []),
    (["service.log_level=debug", "workers.env=Checksum"], ["service.log_level"], ["workers.env"]),
    (["workers.restart_budget=9", "metrics.port=9999", "replay.capacity=2000000"],
     ["workers.restart_budget"], ["replay.capacity", "metrics.port"]),
    (["workers.env_kwargs.max_steps=3"], [], ["workers.env_kwargs"]),
])
def test_reloadable_diff(overrides, live, restart):
    assert reloadable_diff(Config(), load_config(overrides=overrides)) == (live, restart)


def test_live_keys_are_the_documented_ones():
    assert {"workers.count", "service.log_level"} <= LIVE_KEYS
    assert all("Reloadable" in doc for key, _, doc in reference() if key in LIVE_KEYS)
    assert not {"workers.env", "replay.capacity", "control.address", "replay.path"} & LIVE_KEYS


# -- paths ----------------------------------------------------------------------------------------------
HOME = {"HOME": "/home/ann"}


@pytest.mark.parametrize("environ, data_dir, runtime_dir", [
    (HOME, "/home/ann/.local/state/ingestd", "/tmp/ingestd-1000"),
    ({**HOME, "XDG_STATE_HOME": "/xs", "XDG_RUNTIME_DIR": "/run/user/1000"}, "/xs/ingestd", "/run/user/1000/ingestd"),
    ({**HOME, "XDG_STATE_HOME": "relative", "XDG_RUNTIME_DIR": ""}, "/home/ann/.local/state/ingestd",
     "/tmp/ingestd-1000"),
    ({**HOME, "XDG_RUNTIME_DIR": "/run/user/1000", "STATE_DIRECTORY": "/var/lib/ingestd",
      "RUNTIME_DIRECTORY": "/run/ingestd:/run/other"}, "/var/lib/ingestd", "/run/ingestd"),
])
def test_default_paths(environ, data_dir, runtime_dir):
    paths = resolve_paths(Config(), environ, uid=1000)
    assert paths == ResolvedPaths(
        data_dir=Path(data_dir), runtime_dir=Path(runtime_dir), replay=Path(data_dir) / "replay",
        weights=Path(runtime_dir) / "weights", stats=Path(runtime_dir) / "workers.stats",
        control=f"ipc://{runtime_dir}/control.sock", events=f"ipc://{runtime_dir}/events.sock",
        curve_secret_key=None, curve_authorized_keys=None)


def test_configured_paths_win_and_expand_home():
    config = load_config(overrides=[
        "service.data_dir=~/state", "service.runtime_dir=/r", "replay.path=/dev/shm/replay",
        "control.address=tcp://127.0.0.1:7000", "control.curve_secret_key=~/k/server.key",
        "control.curve_authorized_keys=/etc/ingestd/clients"])
    paths = resolve_paths(config, {**HOME, "XDG_STATE_HOME": "/ignored"}, uid=1000)
    assert (paths.data_dir, paths.replay, paths.stats) == (Path("/home/ann/state"), Path("/dev/shm/replay"),
                                                             Path("/r/workers.stats"))
    assert (paths.control, paths.events) == ("tcp://127.0.0.1:7000", "ipc:///r/events.sock")
    assert paths.curve_secret_key == Path("/home/ann/k/server.key")


def test_too_long_default_ipc_path_is_a_config_error():
    with pytest.raises(ConfigError, match="service.runtime_dir") as info:
        resolve_paths(Config(), {**HOME, "XDG_RUNTIME_DIR": "/" + "r" * 100}, uid=1000)
    assert info.value.key == "control.address"


@pytest.mark.parametrize("environ, expected", [
    ({"INGESTD_CONTROL": "tcp://10.0.0.1:7000"}, "tcp://10.0.0.1:7000"),
    ({"INGESTD_CONTROL": "", "XDG_RUNTIME_DIR": "/run/user/7"}, "ipc:///run/user/7/ingestd/control.sock"),
    ({}, "ipc:///tmp/ingestd-7/control.sock"),
])
def test_default_control_address(environ, expected):
    assert default_control_address(environ, uid=7) == expected
    if "INGESTD_CONTROL" not in environ or not environ["INGESTD_CONTROL"]:
        assert resolve_paths(Config(), {**environ, **HOME}, uid=7).control == expected


def test_bad_ingestd_control_names_the_variable():
    with pytest.raises(ConfigError, match="INGESTD_CONTROL"):
        default_control_address({"INGESTD_CONTROL": "localhost:7000"}, uid=7)


def test_a_directory_setting_naming_a_dangling_symlink_says_so(tmp_path):
    """Review: a data dir linked to an unmounted place was "a file, not a directory"."""
    from ingestd.service.instance import make_dir

    link = tmp_path / "data"
    link.symlink_to(tmp_path / "not-mounted")
    with pytest.raises(ConfigError, match=r"config key 'service.data_dir': .*data is a symlink to .*not-mounted, "
                                          r"which is no directory"):
        make_dir(link, "service.data_dir")


def test_a_min_size_the_replay_can_reach_is_fine():
    """The checks above judge only an enabled limiter, and a budget of 0 is no budget."""
    assert load_config(overrides=["limiter.min_size=50000", "workers.total_frames=40000"]).limiter.min_size == 50000
    assert load_config(overrides=["limiter.enabled=true", "limiter.min_size=2000000"]).limiter.enabled  # > capacity
    assert load_config(overrides=["limiter.enabled=true", "limiter.min_size=40000",
                                  "workers.total_frames=40000"]).workers.total_frames == 40000


def test_a_file_saved_with_a_byte_order_mark_is_read(tmp_path):
    """Config review: a BOM (Windows editors add one) failed as "Invalid statement" at line 1,
    column 1, quoting a line that looked right."""
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[workers]\ncount = 3\n")
    assert load_config(path).workers.count == 3


def test_config_check_refuses_an_existing_replay_that_run_would(tmp_path, capsys):
    """A replay at replay.path that the config's rows or capacity do not fit: `check` said "ok;
    reopening it", then `run` exited 78 (walkthrough review: right after changing the env)."""
    from ingestd.replay.storage import ReplayStorage
    from ingestd.service.cli import main
    from ingestd.service.config import resolve_paths
    from ingestd.service.probe import check_buildable

    replay = tmp_path / "replay"
    base = f'[replay]\npath = "{replay}"\ncapacity = 4096\n[workers]\nnum_envs = 4\n'
    config = load_config(write(tmp_path, base), [])
    rows, _ = check_buildable(config, resolve_paths(config, {}))
    ReplayStorage.create(replay, rows, 4096).close()
    before = sorted(p.name for p in replay.iterdir())
    for settings, status, phrase in [
        ([], 0, f"ok; replay {replay} exists: reopening it"),
        (["replay.capacity=8192"], 78, "config key 'replay.capacity': "),
        (['workers.env="Checksum"', 'workers.policy="Random"'], 78, "config key 'replay.path': "),
        (["workers.n_step=3"], 78, "config key 'workers.n_step': "),
    ]:
        got = main(["config", "check", str(write(tmp_path, base)), *[a for s in settings for a in ("--set", s)]])
        out = capsys.readouterr()
        assert got == status and phrase in out.out + out.err, (settings, out)
    assert sorted(p.name for p in replay.iterdir()) == before  # nothing made or changed there


def test_a_bad_ingestd_control_is_named_as_the_environment_variable_it_is():
    """It read "config key 'INGESTD_CONTROL'", a key no config file has (walkthrough review)."""
    from ingestd.service.config import default_control_address

    with pytest.raises(ConfigError) as err:
        default_control_address({"INGESTD_CONTROL": "/run/ingestd/control.sock"})
    assert str(err.value).startswith("environment variable INGESTD_CONTROL: expected ipc:///"), str(err.value)
