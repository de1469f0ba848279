"""``ingestctl`` against a real daemon: every command in text and --json, and its exit codes."""
from __future__ import annotations

import collections
import json
import pickle
import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import control_plugins
from control_daemon import client, daemon, snapshots  # noqa: F401  (pytest fixtures)
from ingestd.control import cli


# the shared control daemon and a client on it: fixtures `daemon` and `client` (control_daemon)


@pytest.fixture
def weights_file(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(control_plugins.weights(3.0), path)
    return str(path)


class NotATensor:
    """Any pickled object: loading it would run code, so weights_only refuses it."""


def run(daemon, capsys, *argv: str, as_json: bool = False) -> tuple[int, str, str]:
    """``ingestctl`` in this process (it starts in well under a second, but torch is already here)."""
    args = ["--connect", daemon.control_address, *(["--json"] if as_json else []), *argv]
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


COMMANDS = [
    (["ping"], "pong", lambda r: r["pong"] is True),
    (["status"], "metrics: off", lambda r: [w["state"] for w in r["workers"]] == ["running", "running"]),
    (["config"], '"workers"', lambda r: r["workers"]["env"] == "Checksum"),
    (["pause"], "paused: workers 0, 1", lambda r: r["workers"] == [0, 1]),
    (["resume"], "resumed: workers 0, 1", lambda r: r["workers"] == [0, 1]),
    (["restart", "1"], "restarted workers 1", lambda r: r["workers"] == [1]),
    (["restart"], "restarted workers 0, 1", lambda r: r["workers"] == [0, 1]),
    (["scale", "3"], "scaled to 3", lambda r: r["workers"] == [0, 1, 2]),
    (["reload"], "reloaded ", lambda r: (r["applied"], r["not_applied"]) == ([], []) and
     r["config_file"].endswith("/ingestd.toml")),
]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("argv, text, check", COMMANDS, ids=[" ".join(c[0]) for c in COMMANDS])
def test_every_command(daemon, client, capsys, argv, text, check, as_json):
    code, out, err = run(daemon, capsys, *argv, as_json=as_json)
    assert code == 0, err
    if as_json:
        doc = json.loads(out)
        assert doc["ok"] is True and check(doc["result"]), doc
    else:
        assert text in out


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_push_weights_file(daemon, client, capsys, weights_file, as_json):
    version = client.status().weights_version
    code, out, err = run(daemon, capsys, "push-weights", weights_file, as_json=as_json)
    assert code == 0, err
    if as_json:
        assert json.loads(out)["result"]["version"] == version + 1
    else:
        assert f"weights v{version + 1}: applied by workers 0, 1" in out
    assert all(w.weights_version == version + 1 for w in client.status().workers)


def test_push_weights_no_wait_says_published_not_applied(daemon, client, capsys, weights_file):
    """Nothing waits for the workers with --no-wait: "applied by workers none" read like a failure."""
    version = client.status().weights_version
    code, out, err = run(daemon, capsys, "push-weights", weights_file, "--no-wait")
    assert code == 0, err
    assert out.startswith(f"weights v{version + 1}: published in ") and \
        "workers apply it between chunks (not waited for)" in out and "applied by" not in out, out


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_push_weights_while_paused_names_the_deferred_workers(daemon, client, capsys, weights_file, as_json):
    client.pause()
    code, out, err = run(daemon, capsys, "push-weights", weights_file, as_json=as_json)
    assert code == 0, err
    if as_json:
        result = json.loads(out)["result"]
        assert (result["applied"], result["deferred"]) == ([], [0, 1]), result
    else:
        assert "applied by workers none" in out and "paused workers 0, 1 apply it on resume" in out, out


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 3)


MODULE = 'holds a pickled nn.Module, not a state dict: save it with torch.save(model.state_dict(), "{}")'
NOT_TORCH = "is not a torch file ("
WRONG_FILES = {  # how to write the file; how the message goes on after the file's name
    "nn.Linear": (lambda f: torch.save(torch.nn.Linear(2, 3), f), MODULE),
    "own nn.Module subclass": (lambda f: torch.save(Net(), f), MODULE),
    "nn.Module, legacy format": (lambda f: torch.save(Net(), f, _use_new_zipfile_serialization=False), MODULE),
    ".npy": (lambda f: np.save(f, np.zeros(3)), "is a NumPy .npy file, not a torch file"),
    ".npz": (lambda f: np.savez(f, a=np.zeros(3)), NOT_TORCH),
    "text": (lambda f: f.write(b"epsilon = 0.1\n"), NOT_TORCH),
    "text 'e'": (lambda f: f.write(b"e"), NOT_TORCH),
    "empty": (lambda f: None, "is empty"),
    "truncated": (lambda f: f.write(_saved({"bias": torch.zeros(1)})[:300]), "is a damaged torch file"),
    "other pickled object": (lambda f: torch.save({"bias": torch.zeros(1), "obj": NotATensor()}, f),
                             "holds pickled Python objects besides tensors (test_ingestctl.NotATensor)"),
    # protocol 4 names the second class's module through the memo: the name must still be right
    "memoized class names": (lambda f: torch.save({"a": collections.Counter(), "b": collections.deque()}, f,
                                                  pickle_protocol=4),
                             "holds pickled Python objects besides tensors (collections.Counter, collections.deque)"),
    # a training checkpoint (user review: "does not hold a state dict", not saying what it did hold)
    "checkpoint": (lambda f: torch.save({"model": torch.nn.Linear(2, 3).state_dict(), "step": torch.tensor(3)}, f),
                   "does not hold a state dict (a non-empty dict of name -> tensor): it holds a dict of 'model', "
                   "'step', of which 'model' is a state dict; pass --key NAME for the entry that is one"),
    # review: described after its "state_dict" entry replaced it, the file "held an empty dict"
    "checkpoint, empty state_dict": (lambda f: torch.save({"state_dict": {}, "model": torch.nn.Linear(2, 3).state_dict()},
                                                          f), "does not hold a state dict (a non-empty dict of name -> tensor): it holds a dict of "
                                         "'state_dict', 'model', of which 'model' is a state dict"),
    # weights review: "a damaged torch file", after torch's multi-line warning on stderr
    **{f"plain pickle, protocol {n}": (lambda f, n=n: pickle.dump({"bias": torch.zeros(1)}, f, protocol=n),
                                       'is a plain pickle (pickle.dump), not a torch file: save the weights with '
                                       'torch.save(model.state_dict(), "{}")') for n in (2, 4)},
    "encrypted zip member": (lambda f: f.write(_encrypted(_saved({"bias": torch.zeros(1), "obj": NotATensor()}))),
                             "cannot be loaded as weights ("),
}


def _encrypted(archive: bytes) -> bytes:
    """A zip whose members are flagged encrypted (zipfile cannot write one; the flag is enough
    for it to refuse reading them)."""
    out = bytearray(archive)
    for signature, flags_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = out.find(signature)
        while at >= 0:
            out[at + flags_at] |= 1
            at = out.find(signature, at + 4)
    return bytes(out)


def test_a_huge_pickle_is_looked_at_not_read_whole(tmp_path):
    """What ingestctl says about a 64 MB pickle that is no state dict, found reading at most
    about 16 MB of it (a mistaken 20 GB file must not be read into memory to be explained)."""
    import pickle
    import tracemalloc

    from ingestd.control import torchfile

    path = tmp_path / "huge.pkl"
    path.write_bytes(pickle.dumps(b"x" * (64 << 20), protocol=4))
    tracemalloc.start()
    try:
        message = torchfile.explain(str(path), RuntimeError("refused"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message.startswith(str(path)) and "weights_only" not in message
    assert peak < 24 << 20, f"explaining a 64 MB pickle took {peak / 2**20:.0f} MB"


def _saved(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch.load on the protocol-4 case
@pytest.mark.parametrize("case", list(WRONG_FILES))
def test_push_weights_says_what_is_wrong_with_the_file(tmp_path, capsys, case):
    """One clear line per kind of wrong file, exit 65; never torch's advice to load with
    weights_only=False (it would run the file's code), never its ANSI escapes. No daemon needed:
    the file is refused before anything is sent."""
    write, expected = WRONG_FILES[case]
    path = tmp_path / "w.pt"
    with open(path, "wb") as f:
        write(f)
    code = cli.main(["--json", "--connect", "ipc:///dev/shm/ingestd-nobody.sock", "push-weights", str(path)])
    out, err = capsys.readouterr()
    assert code == cli.EX_DATAERR, err
    error = json.loads(out)["error"]
    assert error["code"] == "bad_input"
    assert error["message"].startswith(f"{path} {expected.format(path)}"), error["message"]
    assert "weights_only" not in error["message"] and "\x1b" not in err and "\n" not in error["message"]
    assert "Warning" not in err, err  # torch's own warnings stay out of a refusal


def test_push_weights_key_picks_a_checkpoint_entry(tmp_path):
    """``--key model`` pushes a training checkpoint's state dict (the message named the entry,
    but there was no way to use it); a missing entry, or one that is no state dict, says so."""
    path = tmp_path / "ckpt.pt"
    model = torch.nn.Linear(2, 3).state_dict()
    optim = torch.optim.SGD(torch.nn.Linear(2, 3).parameters(), lr=0.1).state_dict()
    torch.save({"model": model, "step": torch.tensor(3), "optim": optim}, path)
    loaded = cli.load_state_dict(str(path), "model")
    assert loaded.keys() == model.keys() and all(torch.equal(loaded[k], model[k]) for k in model)
    with pytest.raises(cli.InputError, match=r"ckpt.pt has no entry 'opt': it holds a dict of 'model', 'step', 'optim'"):
        cli.load_state_dict(str(path), "opt")
    with pytest.raises(cli.InputError, match=r"ckpt.pt's entry 'step' does not hold a state dict .*: it holds a Tensor;"):
        cli.load_state_dict(str(path), "step")
    # the entry's own contents, not the checkpoint's (review: it listed 'model', 'optim' for --key optim)
    with pytest.raises(cli.InputError, match=r"entry 'optim' does not hold a state dict .*: it holds a dict of "
                                             r"'state', 'param_groups';"):
        cli.load_state_dict(str(path), "optim")


def test_exit_codes(daemon, client, capsys, tmp_path):
    wrong = tmp_path / "wrong.pt"
    torch.save({"bias": torch.zeros(3)}, wrong)
    pickled = tmp_path / "pickled.pt"
    torch.save({"bias": torch.zeros(1), "obj": NotATensor()}, pickled)  # refused by weights_only
    cases = [
        (["push-weights", str(wrong)], cli.EX_FAILED, "bad_weights"),
        (["push-weights", str(tmp_path / "missing.pt")], cli.EX_NOINPUT, "no_input"),
        (["push-weights", str(pickled)], cli.EX_DATAERR, "bad_input"),
        (["restart", "9"], cli.EX_FAILED, "no_such_worker"),
        (["pause", "--wait", "0.000001"], cli.EX_TEMPFAIL, "timeout"),
        (["scale", "-1"], cli.EX_USAGE, "usage"),
    ]
    for argv, expected, code in cases:
        status, out, err = run(daemon, capsys, *argv, as_json=True)
        assert status == expected, (argv, out, err)
        assert json.loads(out) == {"ok": False, "error": {"code": code, "message": json.loads(out)["error"]["message"]}}
        assert code in err
    client.resume()  # the timed-out pause stays requested, as documented


@pytest.mark.parametrize("argv", [
    ["limiter", "--spi", "nan"], ["limiter", "--max-diff", "inf"], ["pause", "--wait", "inf"],
    ["resume", "--wait", "nan"], ["scale", "2", "--wait", "0"], ["--timeout", "inf", "ping"],
    ["--timeout", "nan", "status"], ["profile", "0", "--seconds", "inf"], ["events", "--duration", "inf"],
    ["snapshot", "--wait", "nan"], ["--connect", "foo", "ping"], ["--connect", "tcp://*:5555", "status"],
    ["events", "--events", "foo"], ["scale", "abc"], ["frobnicate"], ["pause", "--wait"],
    ["pause", "--wait", "5000"], ["push-weights", "w.pt", "--wait", "4000"],
    ["events", "--count", "0"], ["events", "--count", "-1"], ["events", "--duration", "0"],
    ["events", "--duration", "-1"],
], ids=" ".join)
def test_bad_numbers_and_addresses_are_usage_errors_not_tracebacks(argv, capsys):
    """No daemon is needed: each is refused before anything is sent (nan and inf used to crash in
    the JSON encoder or in poll, a malformed address in ZeroMQ's connect; argparse's own errors
    printed no JSON)."""
    code = cli.main(["--json", *argv])
    out, err = capsys.readouterr()
    assert code == cli.EX_USAGE, err
    assert json.loads(out)["error"]["code"] == "usage" and "Traceback" not in err


SNAPSHOT_FIELDS = {"path", "capacity", "write_count", "rows", "skipped", "bytes", "seconds"}


def test_snapshot(daemon, client, capsys, snapshots):
    code, out, err = run(daemon, capsys, "snapshot", "from-cli", as_json=True)
    assert code == 0, err
    doc = json.loads(out)
    assert out == json.dumps(doc, sort_keys=True) + "\n", "not the stable JSON form"
    assert doc["ok"] is True and set(doc["result"]) == SNAPSHOT_FIELDS, doc
    assert doc["result"]["path"] == str(snapshots / "from-cli") and doc["result"]["rows"] > 0
    code, out, err = run(daemon, capsys, "snapshot")
    assert code == 0, err
    assert out.startswith(f"snapshot {snapshots}/") and " rows of 400000 " in out and out.count("\n") == 1, out
    for argv, expected, error in ((["snapshot", "from-cli"], cli.EX_FAILED, "snapshot_exists"),
                                  (["snapshot", "../from-cli"], cli.EX_FAILED, "bad_request"),
                                  (["snapshot", "--wait", "0"], cli.EX_USAGE, "usage")):
        status, out, err = run(daemon, capsys, *argv, as_json=True)
        assert status == expected, (argv, out, err)
        assert json.loads(out)["error"]["code"] == error and error in err
    assert sorted(p.name for p in snapshots.iterdir() if p.name.startswith("from")) == ["from-cli"]


def test_real_entry_point(daemon, tmp_path):
    """The installed console script, as a shell script would run it."""
    env = {**os.environ, "INGESTD_CONTROL": daemon.control_address}
    exe = [sys.executable, "-m", "ingestd.control.cli"]
    done = subprocess.run([*exe, "--json", "status"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"]["replay"]["write_count"] > 0
    silent = subprocess.run([*exe, "--connect", "ipc:///dev/shm/ingestd-nobody.sock", "--timeout", "0.2", "ping"],
                            capture_output=True, text=True, timeout=30)
    assert silent.returncode == cli.EX_UNAVAILABLE and "no socket" in silent.stderr
    usage = subprocess.run([*exe, "frobnicate"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == cli.EX_USAGE and "invalid choice" in usage.stderr


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_events_follow_the_stream(daemon, client, as_json):
    follower = subprocess.Popen(
        [sys.executable, "-m", "ingestd.control.cli", "--connect", daemon.control_address,
         *(["--json"] if as_json else []), "events", "--topic", "paused", "--topic", "resumed", "--count", "2",
         "--duration", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while follower.poll() is None and time.monotonic() < deadline:
            client.pause()  # repeated: the first ones may go out before the subscription is live
            client.resume()
            time.sleep(0.2)
        out, err = follower.communicate(timeout=10)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    if as_json:
        events = [json.loads(line) for line in lines]
        assert {e["topic"] for e in events} <= {"paused", "resumed"}
        assert all(e["event"]["workers"] == [0, 1] for e in events)
    else:
        assert all((" paused " in line or " resumed " in line) and "workers=[0, 1]" in line for line in lines)


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """``ingestctl status | head -1``: the reader closes the pipe before ingestctl has flushed what
    it printed. Like git and systemctl, ingestctl then exits silently (a BrokenPipeError used to
    reach stderr); keygen prints without a daemon."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    try:
        done = subprocess.run([sys.executable, "-m", "ingestd.control.cli", "keygen", "k", "--dir", str(tmp_path)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (cli.EX_PIPE, "")


def test_keygen_refuses_a_missing_directory(tmp_path, capsys):
    """It used to create the whole tree silently (a typo in --dir made keys nobody looks for)."""
    missing = tmp_path / "no" / "such"
    assert cli.main(["--json", "keygen", "trainer", "--dir", str(missing)]) == cli.EX_CANTCREAT
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "no_directory" and f"create it first: mkdir -m 700 {missing}" in error["message"]
    assert not (tmp_path / "no").exists()
    assert cli.main(["keygen", "--dir", str(tmp_path)]) == cli.EX_USAGE  # NAME is required


def test_keygen_is_shown_with_its_name():
    """Every hint and synopsis shows ``ingestctl keygen NAME [--dir D]``: bare ``keygen`` exits 64."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    texts = {path: path.read_text() for path in (root / "README.md", root / "docs" / "protocol.md",
                                                  *(root / "ingestd" / "control").glob("*.py"))}
    bare = {str(path): re.findall(r".{0,30}\bkeygen`.{0,10}", text) for path, text in texts.items()}
    assert not any(bare.values()), bare
    assert "`keygen NAME [--dir D]`" in texts[root / "README.md"]


def test_a_runtime_dir_that_is_a_file_is_named(tmp_path, capsys):
    """Exhaustion review: with the runtime dir replaced by a file, ingestctl said "you have no
    write access ... join the daemon's group" (to root)."""
    (tmp_path / "run").write_text("")
    code = cli.main(["--json", "--connect", f"ipc://{tmp_path}/run/control.sock", "status"])
    out, err = capsys.readouterr()
    assert code == cli.EX_UNAVAILABLE, err
    message = json.loads(out)["error"]["message"]
    assert f"{tmp_path}/run is not a directory" in message and "write access" not in message, message


def test_a_missing_ipc_socket_fails_at_once(capsys):
    """No socket file: no daemon listens there, so ingestctl says so at once (exit 69), instead
    of retrying for its whole --timeout (5 s) first."""
    t0 = time.monotonic()
    code = cli.main(["--json", "--connect", "ipc:///dev/shm/ingestd-nobody/control.sock", "status"])
    out, err = capsys.readouterr()
    assert code == cli.EX_UNAVAILABLE and time.monotonic() - t0 < 1.0, err
    error = json.loads(out)["error"]
    assert error["code"] == "daemon_unavailable" and "there is no socket at /dev/shm/ingestd-nobody/control.sock" \
        in error["message"]


def test_global_options_may_follow_the_command(daemon, capsys):
    """``ingestctl status --json`` is how people type it: the options every command takes work
    after the command too, and override the ones before it only when given."""
    code = cli.main(["status", "--json", "--connect", daemon.control_address, "--timeout", "7"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["ok"] and "workers" in json.loads(out)["result"]
    code = cli.main(["--json", "--connect", daemon.control_address, "ping", "--timeout", "7"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["result"]["pong"], err  # --json before, --timeout after: both kept


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_limiter_shows_no_error_while_disabled(daemon, client, capsys, as_json):
    """A disabled limiter keeps no error (docs/metrics.md: NaN); its reply says null, not the
    meaningless count of rows inserted since it was last configured."""
    assert client.limiter().error is None
    code, out, err = run(daemon, capsys, "limiter", as_json=as_json)
    assert code == 0, err
    if as_json:
        result = json.loads(out)["result"]
        assert result["enabled"] is False and result["error"] is None
    else:
        assert "limiter disabled" in out and "error: none while disabled" in out, out


def test_keygen_modes(tmp_path, capsys):
    assert cli.main(["--json", "keygen", "trainer", "--dir", str(tmp_path)]) == 0
    paths = json.loads(capsys.readouterr().out)["result"]
    assert stat.S_IMODE(os.stat(paths["secret"]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(paths["public"]).st_mode) == 0o644
    import zmq.auth

    public, secret = zmq.auth.load_certificate(paths["secret"])
    assert secret is not None and zmq.auth.load_certificate(paths["public"]) == (public, None)
    assert cli.main(["keygen", "trainer", "--dir", str(tmp_path)]) == cli.EX_CANTCREAT
    assert cli.main(["keygen", "trainer", "--dir", str(tmp_path), "--force"]) == 0
    assert zmq.auth.load_certificate(paths["secret"])[0] != public


def test_keygen_force_replaces_planted_links_not_their_targets(tmp_path):
    """--force followed links: a secret key went into a file another user could read, and a
    root-owned file linked as srv.key was overwritten and made 0644."""
    victim, theirs = tmp_path / "victim", tmp_path / "theirs"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    theirs.write_text("")
    theirs.chmod(0o666)
    (tmp_path / "srv.key").symlink_to(victim)
    (tmp_path / "srv.key_secret").symlink_to(theirs)
    assert cli.main(["keygen", "srv", "--dir", str(tmp_path)]) == cli.EX_CANTCREAT  # no --force: refused
    assert cli.main(["keygen", "srv", "--dir", str(tmp_path), "--force"]) == 0
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert theirs.read_text() == ""
    for name, mode in (("srv.key", 0o644), ("srv.key_secret", 0o600)):
        path = tmp_path / name
        assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["srv.key", "srv.key_secret", "theirs", "victim"]


def test_a_fifo_among_the_authorised_keys_is_skipped_not_waited_on(tmp_path):
    """A FIFO named evil.key blocked the daemon's main loop on reload until someone wrote to it."""
    import zmq

    from ingestd.control.curve import Authenticator, keygen

    keygen(tmp_path, "alice")
    os.mkfifo(tmp_path / "evil.key")
    (tmp_path / "big.key").write_text("#" * 10_000)
    context = zmq.Context()
    try:
        auth = Authenticator(context, tmp_path)
        try:
            assert auth.reload() == 1  # alice only; returns at once
        finally:
            auth.stop()
    finally:
        context.destroy(linger=0)
