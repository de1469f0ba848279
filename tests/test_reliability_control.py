"""Reliability, the control plane: fuzzing, bad weight pushes, status load with the RSS soak
(authentication: test_reliability_auth.py).

They run against the shared control daemon of the control tests
(tests/control_daemon.py: 2 workers, Checksum, max 4 frames of at most 64 KiB).
``INGESTD_LOAD_SECONDS`` (test-only) sets the loaded time of the status load (default 10 s,
in 2 s windows alternating with as many idle ones; docs/reliability.md quotes a 60 s run).
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass

import lz4.frame
import numpy as np
import pytest
import torch
import zmq

import control_plugins
from control_daemon import client, daemon  # noqa: F401  (pytest fixtures)
from control_daemon import SETTINGS, rows_between
from ingestd import ControlClient
from ingestd.collect.envs.checksum import verify_rows
from ingestd.control.commands import COMMANDS
from ingestd.control.protocol import decode_reply, encode_header
from ingestd.replay import ReplayReader
from ingestd.weights.wire import encode
from reliability_util import (ExternalLoad, RssSeries, idle_and_loaded, knob, load_clients, percentiles, process_cpu,
                              record, wait_for)
from test_control_e2e import BAD_PUSHES, _good, _raw_push, _with_manifest

MAX_FRAMES = SETTINGS["control.max_frames"]
MAX_BYTES = SETTINGS["control.max_message_bytes"]
LOAD_S = knob("INGESTD_LOAD_SECONDS", 10.0)


# the shared control daemon and a client on it: fixtures `daemon` and `client` (control_daemon)


@dataclass
class Ingest:
    """Ingest measured over consecutive windows, from the replay header and /proc (no control traffic)."""

    rates: list[float]  # rows/s per window
    per_cpu_s: list[float]  # rows per CPU-second of the workers, per window
    daemon_cores: float  # CPU the daemon process used (its threads, not the workers), in cores
    external: float  # share of the machine used by processes outside this test (ExternalLoad)

    @property
    def rate(self) -> float:
        return float(np.mean(self.rates))


def measure_ingest(daemon, workers: list[int], windows: int, seconds: float) -> Ingest:
    rates, per_cpu = [], []
    with ReplayReader(daemon.replay_path) as reader:
        load = ExternalLoad()
        d0 = process_cpu(daemon.proc.pid)
        count, t, cpu = reader.write_count, time.monotonic(), sum(process_cpu(p) for p in workers)
        start = t
        for _ in range(windows):
            time.sleep(seconds)
            now_count, now, now_cpu = reader.write_count, time.monotonic(), sum(process_cpu(p) for p in workers)
            rates.append((now_count - count) / (now - t))
            per_cpu.append((now_count - count) / max(1e-6, now_cpu - cpu))
            count, t, cpu = now_count, now, now_cpu
        daemon_cores = (process_cpu(daemon.proc.pid) - d0) / (t - start)
        return Ingest(rates, per_cpu, daemon_cores, load.stop())


def judge_timing(external: float, verdicts: dict[str, bool], figures: str) -> None:
    """Report the timing targets; never fail or skip on them. Speed targets live in the
    benchmarks (the project's rule: tests check behaviour, benchmarks measure), and on a shared
    2-core machine these figures swing by tens of percent with nothing changed in ingestd.
    The verdicts appear in the "reliability figures" summary and in docs/reliability.md."""
    record("timing targets", external_cpu_share=round(external, 3), figures=figures,
           met=sorted(k for k, ok in verdicts.items() if ok),
           missed=sorted(k for k, ok in verdicts.items() if not ok))


# -- 4. fuzzing ------------------------------------------------------------------------------------
# Each generator returns (frames, acceptable reply codes; "ok" for a result). Every message in a
# batch is answered inline by the control thread, so replies come back in order.
_ODD_VALUES = [None, True, False, 0, -1, 1.5, 2**70, "", "x", "1", [], [1], {}, {"a": 1}, "\u2603" * 3]


def _rid(rng: random.Random) -> str:
    return f"fz-{rng.getrandbits(40):x}"


def _header(**fields) -> bytes:
    return json.dumps(fields).encode()


def fuzz_garbage(rng):
    frames = [rng.randbytes(rng.randint(1, 300))] + [rng.randbytes(rng.randint(0, 200))
                                                     for _ in range(rng.randint(0, MAX_FRAMES - 1))]
    return frames, {"bad_request"}


def fuzz_bad_json(rng):
    text = _header(v=1, id=_rid(rng), cmd=rng.choice(sorted(COMMANDS)), args={})
    mangle = rng.randrange(5)
    if mangle == 0:
        text = text[:rng.randint(1, len(text) - 1)]
    elif mangle == 1:
        at = rng.randint(0, len(text))
        text = text[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"]) + text[at:]
    elif mangle == 2:
        text = text.replace(b'"v": 1', b'"v": ' + rng.choice([b"NaN", b"Infinity", b"-Infinity"]))
    elif mangle == 3:
        text += rng.choice([b"x", b"}", b" {}", b"\x00"])
    else:
        depth = rng.randint(1100, 5000)
        text = b"[" * depth + b"]" * depth
    return [text], {"bad_request"}


def fuzz_header_types(rng):
    head = {"v": 1, "id": _rid(rng), "cmd": "ping", "args": {}}
    field = rng.choice(["v", "id", "cmd", "args", "extra"])
    bad = {"v": ["1", 1.0, None, True, 2, 0, [1], {}], "id": [None, True, 1.5, [], {}, "i" * 129, 2**63],
           "cmd": [None, 1, "", [], {}, True], "args": [[], "x", 1, None, True, 1.5]}
    if field == "extra":
        head[rng.choice(["x", "V", "command", "payload"])] = rng.choice(_ODD_VALUES)
    elif rng.random() < 0.15:
        del head[field]
        if field == "args":  # args may be left out: then it is a good ping
            return [_header(**head)], {"ok"}
    else:
        head[field] = rng.choice(bad[field])
    version_bad = "v" not in head or type(head["v"]) is not int or head["v"] != 1
    return [_header(**head)], {"unsupported_version"} if version_bad else {"bad_request"}


def fuzz_unknown_command(rng):
    cmd = rng.choice([
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_-.") for _ in range(rng.randint(1, 30))),
        "".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 10))),
        rng.choice(sorted(COMMANDS)).upper(), rng.choice(sorted(COMMANDS)) + rng.choice([" ", "\x00", "s", "_"]),
        "push-weights", "launch", "shutdown", "exec", "__class__"])
    if cmd in COMMANDS:
        cmd += "!"
    return [_header(v=1, id=_rid(rng), cmd=cmd, args={})], {"unknown_command"}


_BAD_ARGS = {
    "timeout_s": ["1", -1, 0, 3601, 1e308, True, [], {}],
    "workers": ["all", [], [-1], [256], [1.5], [True], {}, 3, [0] * 257, ["0"]],
    "wait": ["yes", 1, 0, None, [], {}],
    "count": [-1, 257, "2", 2.5, True, None, [], {}],
    "name": ["", "n" * 101, 7, 1.5, True, [], {}],  # refused before the daemon looks at the characters
}
_TAKES = {"pause": ["timeout_s"], "resume": ["timeout_s"], "restart": ["workers", "wait", "timeout_s"],
          "scale": ["count", "wait", "timeout_s"], "push_weights": ["wait", "timeout_s"], "snapshot": ["name"]}


def fuzz_bad_arguments(rng):
    cmd = rng.choice(sorted(COMMANDS))
    takes = _TAKES.get(cmd, [])
    payload = [b"m", b"p"] if cmd == "push_weights" else []
    choice = rng.randrange(3)
    if choice == 0 or not takes:  # an argument the command does not have
        args = {rng.choice(["colour", "zz_unknown", "bogus", "__class__"]): rng.choice(_ODD_VALUES)}
    elif choice == 1 or cmd != "push_weights":  # a known argument with a bad value
        name = rng.choice(takes)
        args = {name: rng.choice(_BAD_ARGS[name])}
        if cmd == "scale" and name != "count":
            args["count"] = rng.randint(0, 4)  # the only good argument: the bad one must still refuse it
    else:  # push_weights with the wrong number of payload frames
        args, payload = {"wait": False}, [b"x"] * rng.choice([0, 1, MAX_FRAMES - 1])
    return [_header(v=1, id=_rid(rng), cmd=cmd, args=args), *payload], {"bad_request"}


def fuzz_too_many_frames(rng):
    head = encode_header(_rid(rng), "ping", {})
    return [head] + [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(MAX_FRAMES, 2 * MAX_FRAMES))], \
        {"too_large"}


def fuzz_too_large(rng):
    parts = rng.randint(2, MAX_FRAMES - 1)  # each frame passes MAXMSGSIZE, their sum does not
    return [encode_header(_rid(rng), "ping", {})] + [b"z" * (MAX_BYTES // parts + rng.randint(1, 4000))] * parts, \
        {"too_large"}


def fuzz_req_envelope(rng):
    if rng.random() < 0.5:
        return [b"", encode_header(_rid(rng), rng.choice(["ping", "status", "config"]), {})], {"ok"}
    return [b"", *([rng.randbytes(rng.randint(1, 100))] if rng.random() < 0.8 else [])], {"bad_request"}


def fuzz_canary(rng):
    return [encode_header(_rid(rng), rng.choice(["ping", "status", "config"]), {})], {"ok"}


FUZZERS = [(fuzz_garbage, 20), (fuzz_bad_json, 15), (fuzz_header_types, 20), (fuzz_unknown_command, 10),
           (fuzz_bad_arguments, 20), (fuzz_too_many_frames, 5), (fuzz_too_large, 2), (fuzz_req_envelope, 4),
           (fuzz_canary, 4)]


def bad_lz4(rng) -> bytes:
    manifest, payload = _good()
    kind = rng.randrange(4)
    if kind == 0:
        return payload[:rng.randrange(len(payload))]
    if kind == 1:
        at = rng.randrange(len(payload))
        return payload[:at] + bytes([payload[at] ^ (1 << rng.randrange(8))]) + payload[at + 1:]
    if kind == 2:
        return payload + rng.randbytes(rng.randint(1, 16))
    return rng.randbytes(rng.randint(0, 64))


def _dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@pytest.mark.slow
def test_fuzzed_control_messages_never_hurt_the_daemon(daemon, client):
    rng = random.Random(20261130)
    before = client.status()
    workers = [w.pid for w in before.workers]
    ingest_before = measure_ingest(daemon, workers, 8, 1.0)  # long enough to see the rate's natural drift
    ctx = zmq.Context.instance()
    sock = _dealer(ctx, daemon.control_address)
    counts, codes, pings = Counter(), Counter(), []
    fuzzers, weights = zip(*FUZZERS)
    try:
        with ControlClient(daemon.control_address, timeout=2.0, retries=0) as pinger:
            for batch in range(100):  # 100 batches of 100 messages, answered in order
                sent = []
                for fuzzer in rng.choices(fuzzers, weights, k=100):
                    frames, expected = fuzzer(rng)
                    sock.send_multipart(frames)
                    sent.append((fuzzer.__name__, frames, expected))
                for name, frames, expected in sent:
                    assert sock.poll(5000), f"no reply to {name} {frames!r:.200}"
                    reply = sock.recv_multipart()
                    if frames[0] == b"":  # a REQ-style envelope is answered as one
                        assert reply[0] == b"", reply
                        reply = reply[1:]
                    answer = decode_reply(reply)
                    code = "ok" if answer.ok else answer.code
                    assert code in expected, f"{name}: {code} ({answer.message}) for {frames!r:.300}"
                    counts[name] += 1
                    codes[code] += 1
                if batch % 5 == 0:
                    t0 = time.perf_counter()
                    assert pinger.ping()["pong"]
                    pings.append(time.perf_counter() - t0)
            for _ in range(300):  # truncated / corrupted lz4 in push_weights: one at a time (the pool)
                frames = [encode_header(_rid(rng), "push_weights", {"wait": False}), _good()[0], bad_lz4(rng)]
                sock.send_multipart(frames)
                assert sock.poll(5000), "no reply to a bad push"
                answer = decode_reply(sock.recv_multipart())
                assert answer.code == "bad_weights", (answer, frames[2][:40])
                counts["bad_lz4_push"] += 1
                codes[answer.code] += 1
            huge = [_dealer(ctx, daemon.control_address) for _ in range(20)]  # over MAXMSGSIZE: dropped, no reply
            try:
                for s in huge:
                    size = rng.randint(MAX_BYTES + 1, 4 * MAX_BYTES)
                    s.send_multipart([encode_header(_rid(rng), "ping", {}), b"h" * size])
                time.sleep(1.0)
                assert not [s for s in huge if s.poll(0)], "a frame over MAXMSGSIZE got a reply"
                counts["huge_frame"] += len(huge)
            finally:
                for s in huge:
                    s.close(0)
            t0 = time.perf_counter()
            assert pinger.ping()["pong"]
            pings.append(time.perf_counter() - t0)
    finally:
        sock.close(0)
    ingest_after = measure_ingest(daemon, workers, 4, 1.0)
    after = client.status()
    assert daemon.proc.poll() is None
    assert [(w.pid, w.restarts, w.state) for w in after.workers] == \
        [(w.pid, w.restarts, "running") for w in before.workers], "a worker was disturbed"
    assert after.weights_version == before.weights_version and after.count == before.count
    assert "Traceback" not in daemon.log() and "unexpected error" not in daemon.log()
    assert codes["internal"] == 0
    total = sum(counts.values())
    b, a = ingest_before.rate, ingest_after.rate
    # noise: the rate's own variation over the 8 s before the fuzzing (2 standard deviations; on
    # the 2-core VM it drifts by up to ~25 % over tens of seconds with nothing else running)
    noise = 2 * float(np.std(ingest_before.rates))
    external = max(ingest_before.external, ingest_after.external)
    record("4 control fuzzing", messages=total, **{f"n_{k.removeprefix('fuzz_')}": v for k, v in counts.items()},
           replies=dict(codes), ping_max_ms=round(1e3 * max(pings), 2), ingest_before_rows_s=round(b),
           ingest_after_rows_s=round(a), change_pct=round(100 * (a / b - 1), 1), noise_pct=round(100 * noise / b, 1),
           rows_per_worker_cpu_s_before=round(float(np.mean(ingest_before.per_cpu_s))),
           rows_per_worker_cpu_s_after=round(float(np.mean(ingest_after.per_cpu_s))),
           daemon_cpu_pct_before=round(100 * ingest_before.daemon_cores, 1),
           daemon_cpu_pct_after=round(100 * ingest_after.daemon_cores, 1), external_load_pct=round(100 * external))
    assert total >= 10_000
    # nothing left running in the daemon (a spinning thread would take the workers' CPU). The
    # daemon's own share is a few % of a core, counted in 10 ms ticks over 8 s / 4 s windows: the
    # margin absorbs that noise on a slow machine, a thread left busy (10 % of a core or more) does not fit
    assert ingest_after.daemon_cores <= 1.5 * ingest_before.daemon_cores + 0.05, (ingest_before, ingest_after)
    judge_timing(external, {"ingest rate within noise": a >= b - max(noise, 0.1 * b)},
                 f"ingest {b:.0f} rows/s before, {a:.0f} after; windows {ingest_before.rates} {ingest_after.rates}")


# -- 5. bad weights ----------------------------------------------------------------------------------
def _lz4(raw: bytes, **kw) -> bytes:
    return lz4.frame.compress(raw, **{"content_checksum": True, **kw})


MORE_BAD_PUSHES = {
    "zero-length payload": lambda: [_good()[0], b""],
    "zero-length manifest": lambda: [b"", _good()[1]],
    "both frames empty": lambda: [b"", b""],
    "+Inf": lambda: encode({"bias": torch.tensor([float("inf")])}),
    "float16": lambda: encode({"bias": torch.zeros(1, dtype=torch.float16)}),
    "scalar instead of [1]": lambda: encode({"bias": torch.tensor(0.5)}),
    "missing name": lambda: _with_manifest(lambda m: m.update(entries=[])),
    "duplicated name": lambda: [_with_manifest(lambda m: m.update(entries=m["entries"] * 2, raw_bytes=8))[0],
                                _lz4(b"\0" * 8)],
    "manifest says 4 bytes, lz4 frame holds 8": lambda: [_good()[0], _lz4(b"\0" * 8)],
    "lz4 frame holds 8 bytes, no size in its header": lambda: [_good()[0], _lz4(b"\0" * 8, store_size=False)],
    "manifest claims a huge shape": lambda: _with_manifest(
        lambda m: m.update(entries=[{**m["entries"][0], "shape": [1 << 40]}], raw_bytes=4 << 40)),
    "negative raw_bytes": lambda: _with_manifest(lambda m: m.update(raw_bytes=-4)),
    "raw_bytes as text": lambda: _with_manifest(lambda m: m.update(raw_bytes="4")),
    "wire version 2": lambda: _with_manifest(lambda m: m.update(v=2)),
    "codec zstd": lambda: _with_manifest(lambda m: m.update(codec="zstd")),
    "manifest is a list": lambda: [b"[]", _good()[1]],
    "truncated manifest": lambda: [_good()[0][:-3], _good()[1]],
    "no content checksum": lambda: [_good()[0], lz4.frame.compress(b"\0" * 4, content_checksum=False)],
    "bytes after the lz4 frame": lambda: [_good()[0], _good()[1] + b"\0\0\0\0"],
}


def test_bad_weight_pushes_are_rejected_then_a_good_one_works(daemon, client):
    cases = {**BAD_PUSHES, **MORE_BAD_PUSHES}
    version = client.status().weights_version
    rejected = []
    for name, frames in cases.items():
        reply = _raw_push(daemon, frames())
        assert reply is not None and not reply.ok and reply.code == "bad_weights", (name, reply)
        status = client.status()
        assert status.weights_version == version, name
        assert all(w.weights_version == version for w in status.workers), name
        rejected.append(name)
    before = client.push_weights(control_plugins.weights(0.0))  # action 0 ...
    assert before == version + 1
    pushed = client.push_weights_detailed(control_plugins.weights(1.0))  # ... then action 1, from this version on
    assert pushed.version == before + 1 and pushed.applied == [0, 1]
    start = client.status().replay.write_count
    wait_for(lambda: client.status().replay.write_count > start + 2000, 10, "rows under the good weights")
    rows = rows_between(daemon.replay_path, start, client.status().replay.write_count)
    stamped = rows.get(("ingestd", "policy_version")) == pushed.version
    assert int(stamped.sum()) > 1000 and bool((rows.get("action").reshape(-1)[stamped] == 1).all())
    assert bool(verify_rows(rows).all())
    record("5 bad weights", bad_pushes_rejected=len(rejected), version_unchanged=True,
           good_push_version=pushed.version, good_push_applied_by=len(pushed.applied))


# -- 8 + 9. status load, and the RSS soak ----------------------------------------------------------
# The clients are lean raw-DEALER loops (test_control_load.py): they share the machine with the
# workers, so their CPU counts in the slowdown; it is recorded apart from the daemon's.
CLIENTS, RATE, WINDOW_S = 4, 1000.0, 2.0
# Workers during the load: with every core running a worker, whatever CPU the clients use is taken
# from collection, whatever the daemon does; one core is left to the control plane and its clients.
LOAD_WORKERS = int(knob("INGESTD_LOAD_WORKERS", 1, unit="workers"))


@pytest.mark.slow
def test_status_load_latency_ingest_and_rss(daemon, client, tmp_path):
    rounds = max(1, math.ceil(LOAD_S / WINDOW_S))
    client.scale(LOAD_WORKERS)
    status = client.status()
    pids = [daemon.proc.pid] + [w.pid for w in status.workers]
    start = time.monotonic() + 3.0  # the clients start meanwhile
    rss = RssSeries()
    with load_clients(daemon.control_address, CLIENTS, RATE, start, WINDOW_S, rounds) as results, \
            ReplayReader(daemon.replay_path) as reader:
        while time.monotonic() < start:
            rss.sample(pids)
            time.sleep(0.25)
        load = ExternalLoad()
        counts = []
        for edge in [start + k * WINDOW_S for k in range(2 * rounds + 1)]:
            while (now := time.monotonic()) < edge:
                rss.sample(pids)
                time.sleep(min(0.25, max(0.0, edge - now)))
            counts.append((reader.write_count, time.monotonic(), process_cpu(daemon.proc.pid),
                           sum(process_cpu(p) for p in pids[1:])))
        external = load.stop()
    (idle, loaded), daemon_cpu, worker_cpu, seconds = idle_and_loaded(counts)
    latency = np.concatenate([r["latency"] for r in results])
    late = np.concatenate([r["late"] for r in results])
    client_cpu = sum(float(r["cpu_s"]) for r in results)
    p50, p99, worst = percentiles(latency, 50, 99, 100)
    # sent inside the loaded windows (latency.size is fixed by the schedule: a client that falls
    # behind still sends every request, late, and would seem to reach the rate)
    served = sum(int(r["in_window"]) for r in results)  # sent inside the loaded windows, where CPU is counted
    achieved = served / (rounds * WINDOW_S)
    slowdown = 1 - float(np.median([b / a for a, b in zip(idle, loaded)]))  # adjacent idle/loaded pairs
    drift = rss.drift(warmup_s=min(5.0, rounds * WINDOW_S / 2))
    after = client.status()
    assert [w.pid for w in after.workers] == pids[1:] and daemon.proc.poll() is None
    record("8 control load", clients=CLIENTS, workers=LOAD_WORKERS, loaded_s=rounds * WINDOW_S,
           requests=int(latency.size), achieved_per_s=round(achieved), p50_ms=round(1e3 * p50, 3),
           p99_ms=round(1e3 * p99, 3), max_ms=round(1e3 * worst, 2),
           p99_behind_schedule_ms=round(1e3 * percentiles(late, 99)[0], 2),
           ingest_idle_rows_s=round(float(np.mean(idle))), ingest_loaded_rows_s=round(float(np.mean(loaded))),
           slowdown_pct=round(100 * slowdown, 1), external_load_pct=round(100 * external),
           worker_cores_idle=round(worker_cpu[0] / seconds[0], 3),
           worker_cores_loaded=round(worker_cpu[1] / seconds[1], 3),
           daemon_cpu_us_per_request=round(1e6 * (daemon_cpu[1] - daemon_cpu[0]) / max(1, served), 1),
           client_cpu_us_per_request=round(1e6 * client_cpu / latency.size, 1))
    record("9 RSS soak", seconds=round(2 * rounds * WINDOW_S + 3), daemon_drift_pct=round(100 * drift[pids[0]], 2),
           worker_drift_pct=[round(100 * drift[p], 2) for p in pids[1:]],
           daemon_rss_anon_mib=round(rss.samples[pids[0]][-1][1] / 1024, 1),
           worker_rss_anon_mib=[round(rss.samples[p][-1][1] / 1024, 1) for p in pids[1:]])
    assert all(d <= 0.05 for d in drift.values()), f"RSS grew: {drift}"
    # how fast the clients could send depends on the machine: a timing figure like the others
    judge_timing(external, {"status p99 <= 5 ms": p99 <= 0.005, "ingest slowdown <= 5 %": slowdown <= 0.05,
                            f"clients kept {RATE:.0f} requests/s": achieved >= 0.95 * RATE},
                 f"p50 {1e3 * p50:.2f} ms, p99 {1e3 * p99:.2f} ms, ingest {np.mean(idle):.0f} -> "
                 f"{np.mean(loaded):.0f} rows/s ({100 * slowdown:.1f} % slower), {achieved:.0f} requests/s "
                 "sent in the loaded windows")


@pytest.mark.parametrize("target", [4, 0])
def test_a_sighup_waits_for_a_scale_in_flight_instead_of_undoing_it(daemon, client, target):
    """A SIGHUP reloaded in the main loop, outside the lock that serialises changes: racing a
    ``scale(4)`` it set the count back to the file's 2, and the scale waited its whole deadline
    for workers that would never start, then said "the request stays in effect" (chaos review).
    Now the reload waits for the scale: the scale succeeds, then the file's count applies."""
    import os
    import signal
    import threading

    got: dict = {}

    def scale() -> None:
        started = time.monotonic()
        try:
            got["result"] = client.scale(target, timeout_s=8.0)
        except Exception as exc:  # noqa: BLE001 - reported below
            got["result"] = exc
        got["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=scale)
    thread.start()
    time.sleep(0.01)
    os.kill(daemon.proc.pid, signal.SIGHUP)
    thread.join(30)
    assert not isinstance(got["result"], Exception), got["result"]
    assert got["seconds"] < 8.0, got
    with ControlClient(daemon.control_address, timeout=5.0) as c:
        wait_for(lambda: c.status().count == 2 and len(c.status().workers) == 2, 20,
                 "the reload (count = 2 from --set) to apply after the scale")


def test_a_push_that_times_out_says_which_version_it_published(daemon, client):
    """The version of a push(wait=True) that timed out was published all the same, but only the
    error text said which (chaos review): a trainer mapping versions to checkpoints needs it."""
    import os
    import signal

    from ingestd.errors import CommandFailed

    wait_for(lambda: client.status().workers[0].state == "running", 20, "worker 0 to run")
    pid = client.status().workers[0].pid
    assert pid > 0  # (os.kill(0, ...) would stop this test's own process group)
    os.kill(pid, signal.SIGSTOP)  # a hang (well inside the heartbeat timeout)
    try:
        with pytest.raises(CommandFailed) as failed:
            client.push_weights(control_plugins.weights(1.0), wait=True, timeout_s=0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert failed.value.code == "timeout"
    version = failed.value.details["version"]
    assert client.status().weights_version == version and f"version {version}" in failed.value.message
