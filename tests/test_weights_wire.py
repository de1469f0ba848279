"""The weight wire format: round trips (property-based) and every way a payload can be bad."""
from __future__ import annotations

import json
import tracemalloc

import lz4.frame
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ingestd.errors import BadWeights
from ingestd.weights import Entry, Manifest, decode, encode, manifest_of

DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


def make_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


shapes = st.lists(st.integers(0, 5), max_size=4).map(tuple)
entries = st.tuples(st.sampled_from(DTYPES), shapes, st.integers(0, 2**31))
state_dicts = st.lists(entries, min_size=1, max_size=6).map(
    lambda specs: {f"layer{i}.p": make_tensor(d, s, seed) for i, (d, s, seed) in enumerate(specs)})


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@settings(max_examples=150, deadline=None)
@given(state_dicts)
def test_round_trip(state):
    frames = encode(state)
    assert len(frames) == 2 and all(isinstance(f, bytes) for f in frames)
    decoded = decode(frames, expected=manifest_of(state))
    assert_same(decoded, state)
    for tensor in decoded.values():  # owned, writable memory, not a view of the payload
        assert tensor.is_contiguous()
        tensor.fill_(0)


@settings(max_examples=100, deadline=None)
@given(state_dicts)
def test_manifest_json_round_trip(state):
    manifest = manifest_of(state)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in state.values())


def test_module_memoryviews_and_scalars():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))  # has an int64 0-d buffer
    frames = encode(module)
    decoded = decode([memoryview(frames[0]), bytearray(frames[1])], expected=manifest_of(module))
    assert_same(decoded, module.state_dict())
    assert decoded["1.num_batches_tracked"].shape == ()


def test_non_contiguous_and_grad_tensors_are_encoded_as_values():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"t": base.t(), "g": torch.ones(2, requires_grad=True)}
    assert_same(decode(encode(state)), {"t": base.t().contiguous(), "g": torch.ones(2)})


@pytest.mark.parametrize("state, message", [
    ({}, "empty state dict"),
    ({"a": np.zeros(3)}, "expected a dense torch.Tensor"),
    ({"a": torch.zeros(2, dtype=torch.complex64)}, "cannot travel"),
    ({"a": torch.zeros(2).to_sparse()}, "dense"),
    ([torch.zeros(2)], "mapping of name -> tensor"),
    ({3: torch.zeros(2)}, "non-empty strings"),
    ({"a": torch.zeros(2, device="meta")}, "meta tensor: it has no data"),
    ({"a": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])}, "nested tensor"),  # was a RuntimeError
], ids=["empty", "numpy", "complex", "sparse", "list", "int-key", "meta", "nested"])
def test_encode_rejects(state, message):
    with pytest.raises(BadWeights, match=message):
        encode(state)


# -- bad payloads ---------------------------------------------------------------------
GOOD = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.float64)}
RAW = b"".join(t.numpy().tobytes() for t in GOOD.values())
HEADER = {"v": 1, "codec": "lz4", "raw_bytes": len(RAW),
          "entries": [{"name": "w", "dtype": "float32", "shape": [2, 3]},
                      {"name": "b", "dtype": "float64", "shape": [3]}]}


def frames(header=None, payload=None, **changes) -> list[bytes]:
    """Valid frames for GOOD, with header keys replaced by ``changes``."""
    head = {**HEADER, **changes} if header is None else header
    head = head if isinstance(head, bytes) else json.dumps(head).encode()
    return [head, lz4.frame.compress(RAW, content_checksum=True) if payload is None else payload]


def entry(name="w", dtype="float32", shape=(2, 3)):
    return {"name": name, "dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape}


def with_values(**tensors) -> list[bytes]:
    return encode({**GOOD, **tensors})


CORRUPT = bytearray(lz4.frame.compress(RAW, content_checksum=True))
CORRUPT[20] ^= 0xFF
BAD_CASES = [
    ("one-frame", lambda: frames()[:1], "must be 2 frames"),
    ("three-frames", lambda: frames() + [b""], "must be 2 frames"),
    ("bytes-not-list", lambda: b"abc", "list of 2 frames"),
    ("frame-not-bytes", lambda: [frames()[0], 42], "frame 1 is a int, not bytes"),
    ("bad-json", lambda: frames(b"{not json"), "not valid UTF-8 JSON"),
    ("not-utf8", lambda: frames(b"\xff\xfe{}"), "not valid UTF-8 JSON"),
    ("nested-too-deep", lambda: frames(b"[" * 100_000), "not valid UTF-8 JSON"),  # RecursionError, not internal
    ("json-list", lambda: frames([1, 2]), "must be a JSON object"),
    ("wrong-version", lambda: frames(v=2), "version 2 is not supported"),
    ("wrong-codec", lambda: frames(codec="zstd"), "unsupported codec 'zstd'"),
    ("raw-bytes-string", lambda: frames(raw_bytes="72"), "'raw_bytes' must be a non-negative integer"),
    ("raw-bytes-bool", lambda: frames(raw_bytes=True), "'raw_bytes' must be a non-negative integer"),
    ("raw-bytes-negative", lambda: frames(raw_bytes=-1), "'raw_bytes' must be a non-negative integer"),
    ("entries-missing", lambda: frames({k: v for k, v in HEADER.items() if k != "entries"}),
     "'entries' must be a list"),
    ("entries-empty", lambda: frames(entries=[], raw_bytes=0), "no entries"),
    ("entry-not-object", lambda: frames(entries=[["w", "float32", [2, 3]]]), "entry 0 must be an object"),
    ("name-not-string", lambda: frames(entries=[entry(name=7)]), "'name' must be a non-empty string"),
    ("name-empty", lambda: frames(entries=[entry(name="")]), "'name' must be a non-empty string"),
    ("duplicate-names", lambda: frames(entries=[entry(), entry()]), "unique; repeated: 'w'"),
    ("unknown-dtype", lambda: frames(entries=[entry(dtype="float128")]), "unknown dtype 'float128'"),
    ("dtype-not-string", lambda: frames(entries=[entry(dtype=4)]), "unknown dtype 4"),
    ("shape-not-list", lambda: frames(entries=[entry(shape="23")]), "'shape' must be a list"),
    ("shape-negative", lambda: frames(entries=[entry(shape=(2, -3))]), "non-negative integers"),
    ("shape-float", lambda: frames(entries=[entry(shape=(2.0, 3))]), "non-negative integers"),
    ("shape-bool", lambda: frames(entries=[entry(shape=(True, 3))]), "non-negative integers"),
    ("shape-too-many-dims", lambda: frames(entries=[entry(shape=(1,) * 33)]), "at most 32 sizes"),
    ("shape-huge", lambda: frames(entries=[entry(shape=(2**30, 2**6))]), r"needs \d+ bytes, over the limit"),
    ("manifest-lies", lambda: frames(raw_bytes=len(RAW) + 8), f"entries add up to {len(RAW)}"),
    ("zero-length-payload", lambda: frames(payload=b""), "empty \\(zero-length\\)"),
    ("payload-not-lz4", lambda: frames(payload=b"definitely not lz4"), "not an lz4 frame"),
    ("no-checksum", lambda: frames(payload=lz4.frame.compress(RAW)), "no content checksum"),
    ("truncated", lambda: frames(payload=frames()[1][:-12]), "truncated"),
    ("corrupt", lambda: frames(payload=bytes(CORRUPT)), "corrupt"),
    ("trailing-bytes", lambda: frames(payload=frames()[1] + b"junk"), "4 bytes after the end"),
    ("header-size-lies", lambda: frames(payload=lz4.frame.compress(RAW[:-8], content_checksum=True)),
     f"lz4 header says {len(RAW) - 8} bytes, manifest says {len(RAW)}"),
    ("too-short", lambda: frames(payload=lz4.frame.compress(RAW[:-8], content_checksum=True, store_size=False)),
     f"decompresses to {len(RAW) - 8} bytes, manifest declares {len(RAW)}"),
    ("too-long", lambda: frames(payload=lz4.frame.compress(RAW + b"x" * 8, content_checksum=True,
                                                           store_size=False)),
     f"more than the declared {len(RAW)}"),
    ("nan", lambda: with_values(w=torch.tensor([1.0, float("nan")])), "non-finite .* in 'w'"),
    ("inf", lambda: with_values(b=torch.tensor([float("inf")], dtype=torch.float64)), "non-finite .* in 'b'"),
    ("minus-inf-f16", lambda: with_values(h=torch.tensor(float("-inf")).half()), "non-finite .* in 'h'"),
    ("nan-bf16", lambda: with_values(h=torch.full((2, 2), float("nan")).bfloat16()), "non-finite .* in 'h'"),
    ("huge-empty-shape", lambda: frames(entries=[entry("e", "float32", (2**63, 0))], raw_bytes=0,
                                        payload=lz4.frame.compress(b"", content_checksum=True)),
     "too large for any tensor"),  # 0 bytes, yet numpy refused it: a ValueError, not BadWeights
    ("bool-not-0-1", lambda: frames(entries=[entry("m", "bool", (4,))], raw_bytes=4,
                                    payload=lz4.frame.compress(b"\x00\x01\x02\x00", content_checksum=True)),
     "bytes other than 0 and 1"),
]


@pytest.mark.parametrize("make, message", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_decode_rejects(make, message):
    with pytest.raises(BadWeights, match=message):
        decode(make())


def test_manifest_from_json_rejects_deep_nesting_as_bad_weights():
    with pytest.raises(BadWeights, match="not valid UTF-8 JSON"):
        Manifest.from_json(b"[" * 100_000)


def test_good_frames_helper_is_valid():
    assert_same(decode(frames()), GOOD)


def test_large_finite_float32_is_not_mistaken_for_overflow():
    state = {"big": torch.full((1000,), 3e38, dtype=torch.float32)}
    assert_same(decode(encode(state)), state)


EXPECTED = Manifest((Entry("w", "float32", (2, 3)), Entry("b", "float64", (3,)), Entry("c", "int64", ())))


@pytest.mark.parametrize("state, messages", [
    ({"w": GOOD["w"], "b": GOOD["b"]}, ["missing 'c'"]),
    ({**GOOD, "c": torch.tensor(1), "extra": torch.ones(1)}, ["unexpected 'extra'"]),
    ({"w": GOOD["w"].t(), "b": GOOD["b"], "c": torch.tensor(1)}, ["'w' is float32[3, 2], expected float32[2, 3]"]),
    ({**GOOD, "c": torch.tensor(1.0)}, ["'c' is float32[], expected int64[]"]),
    ({"w": GOOD["w"], "x": torch.ones(1)}, ["missing 'b', 'c'", "unexpected 'x'"]),
    # a DistributedDataParallel model's state_dict (user review: 7 missing, 7 unexpected, no hint)
    ({f"module.{k}": v for k, v in {**GOOD, "c": torch.tensor(1)}.items()},
     ["the pushed names are the policy's with 'module.' in front", "model.module"]),
], ids=["missing", "unexpected", "shape", "dtype", "several", "ddp-prefix"])
def test_decode_checks_expected_manifest(state, messages):
    with pytest.raises(BadWeights, match="do not match the policy") as info:
        decode(encode(state), expected=EXPECTED)
    for message in messages:
        assert message in str(info.value)


def test_a_bare_network_pushed_to_the_mlp_policy_is_told_what_to_push():
    """A trainer's own nn.Sequential for the built-in MLP policy was refused with 'missing
    epsilon, net.0.weight...; unexpected 0.weight...' and no hint (trainer review)."""
    from ingestd.collect.policies import mlp_qnet

    policy = manifest_of(mlp_qnet(4, 2, (64, 64)).state_dict())
    layers = [torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)]
    with pytest.raises(BadWeights) as info:
        decode(encode(torch.nn.Sequential(*layers).state_dict()), expected=policy)
    assert "without 'net.' in front" in str(info.value) and "mlp_qnet(" in str(info.value), str(info.value)
    assert "'epsilon' is the built-in MLP's exploration rate" in str(info.value)
    no_epsilon = {k: v for k, v in mlp_qnet(4, 2, (64, 64)).state_dict().items() if k != "epsilon"}
    with pytest.raises(BadWeights) as info:
        decode(encode(no_epsilon), expected=policy)
    assert "missing 'epsilon'" in str(info.value) and "exploration rate" in str(info.value)
    assert "in front" not in str(info.value)  # nothing was unexpected: no prefix to speak of
    with_epsilon = {"epsilon": torch.tensor(0.1), **torch.nn.Sequential(*layers).state_dict()}  # review
    with pytest.raises(BadWeights) as info:
        decode(encode(with_epsilon), expected=policy)
    assert "without 'net.' in front" in str(info.value) and "exploration rate" not in str(info.value)
    wrapped = {f"module.{k}": v for k, v in mlp_qnet(4, 2, (64, 64)).state_dict().items()}  # DDP: epsilon is there
    with pytest.raises(BadWeights) as info:
        decode(encode(wrapped), expected=policy)
    assert "with 'module.' in front" in str(info.value) and "exploration rate" not in str(info.value)


def test_size_mismatch_with_policy_is_reported_as_a_mismatch_not_a_cap():
    state = {**GOOD, "c": torch.tensor(1), "w": torch.zeros(20, 30)}
    with pytest.raises(BadWeights, match="'w' is float32\\[20, 30\\], expected float32\\[2, 3\\]"):
        decode(encode(state), expected=EXPECTED, max_raw_bytes=EXPECTED.total_bytes)


def test_zmq_frames_decode_without_copies():
    zmq = pytest.importorskip("zmq")
    with zmq.Context() as ctx, ctx.socket(zmq.PAIR) as a, ctx.socket(zmq.PAIR) as b:
        a.bind("inproc://weights")
        b.connect("inproc://weights")
        a.send_multipart(encode(GOOD))
        assert_same(decode(b.recv_multipart(copy=False), expected=manifest_of(GOOD)), GOOD)


def test_expected_manifest_ignores_order():
    state = {"c": torch.tensor(7), "b": GOOD["b"], "w": GOOD["w"]}
    assert_same(decode(encode(state), expected=EXPECTED), state)


def test_raw_size_cap_is_checked_before_decompressing():
    with pytest.raises(BadWeights, match=f"declares {len(RAW)} raw bytes, over the limit of 40"):
        decode(frames(), max_raw_bytes=40)
    state = {**GOOD, "c": torch.tensor(1)}
    with pytest.raises(BadWeights, match="declares 56 raw bytes, over the limit of 10"):
        decode(encode(state), expected=EXPECTED, max_raw_bytes=10)
    with pytest.raises(BadWeights, match="over the limit"):
        decode(frames(b"x" * 100), max_manifest_bytes=99)


@pytest.mark.parametrize("store_size", [True, False], ids=["size-in-header", "no-size"])
def test_decompression_bomb_is_rejected_cheaply(store_size, monkeypatch):
    """Refused after decompressing at most the declared 8 bytes (+1 to see the excess): counted, not
    timed. (Streaming the whole 64 MiB in small pieces takes well under 0.1 s here and little
    memory, so neither a time limit nor the memory peak alone would notice it.)"""
    bomb = lz4.frame.compress(bytes(64 << 20), content_checksum=True, store_size=store_size)
    assert len(bomb) < 1 << 20  # 64 MiB of zeros, ~0.25 MiB on the wire
    head = json.dumps({**HEADER, "entries": [entry("w", "float32", (2,))], "raw_bytes": 8}).encode()
    produced, chunk = [], lz4.frame.decompress_chunk

    def counting_chunk(*args, **kwargs):
        out = chunk(*args, **kwargs)
        produced.append(len(out[0]))
        return out

    monkeypatch.setattr(lz4.frame, "decompress_chunk", counting_chunk)
    tracemalloc.start()
    try:
        with pytest.raises(BadWeights, match="lz4 header says" if store_size else "more than the declared 8"):
            decode([head, bomb])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(produced) <= 8 + 1 and peak < 1 << 20, (sum(produced), peak)


def test_a_negative_view_travels_as_its_values():
    """``x.neg()`` may be a lazy negative view (``torch._neg_view``): numpy() refused it, a RuntimeError."""
    state = decode(encode({"a": torch._neg_view(torch.ones(3))}))
    assert torch.equal(state["a"], -torch.ones(3))


def test_a_compiled_module_travels_under_its_own_names():
    """A trainer pushing its torch.compile'd Q-net was refused: '_orig_mod.0.weight' is unknown."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    compiled = torch.compile(net)  # compiles lazily: nothing is compiled until it is called
    want = [entry.name for entry in manifest_of(net).entries]
    assert [entry.name for entry in manifest_of(compiled).entries] == want
    assert [entry.name for entry in manifest_of(compiled.state_dict()).entries] == want
    state = decode(encode(compiled))
    assert list(state) == want and all(torch.equal(state[k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize("mine, theirs, prefix", [
    (["weight", "a.weight"], ["module.a.weight", "module.weight"], "module."),  # review: the first match misled
    (["module.w", "w"], ["module.module.w", "module.w"], "module."),  # a wrapped model wrapped again
    (["w", "b"], ["x.w", "y.b"], None),
    (["w"], ["w"], None),  # nothing to strip (the names match: no hint is asked for)
])
def test_a_common_prefix_of_the_pushed_names_is_found_over_every_name(mine, theirs, prefix):
    from ingestd.weights.wire import Entry, _common_prefix

    def entries(names):
        return {n: Entry(n, "float32", (2,)) for n in names}

    assert _common_prefix(entries(mine), entries(theirs)) == prefix


def test_a_prefix_is_suggested_only_where_the_shapes_fit_too():
    """A plain nn.Linear(4, 2) pushed to the MLP was told to add the prefix 'net.2.', whose weight
    is [64, 64]: adding it would still be refused; and mlp_qnet was suggested for any policy
    (walkthrough review)."""
    from ingestd.collect.policies import mlp_qnet

    policy = manifest_of(mlp_qnet(4, 2, (64, 64)).state_dict())
    with pytest.raises(BadWeights) as info:
        decode(encode(torch.nn.Linear(4, 2).state_dict()), expected=policy)
    assert "in front" not in str(info.value) and "missing" in str(info.value), str(info.value)
    actor = manifest_of({"linear.weight": torch.zeros(1, 1), "linear.bias": torch.zeros(1)})  # a custom policy
    with pytest.raises(BadWeights) as info:
        decode(encode(torch.nn.Linear(2, 1).state_dict()), expected=actor)  # [1, 2]: not linear.weight's [1, 1]
    assert "in front" not in str(info.value), str(info.value)
    with pytest.raises(BadWeights) as info:
        decode(encode(torch.nn.Linear(1, 1).state_dict()), expected=actor)  # fits under 'linear.'
    assert "without 'linear.' in front" in str(info.value) and "mlp_qnet" not in str(info.value), str(info.value)
