"""Property tests: ring arithmetic and wrap-around, FIFO overwrite order and write_count,
the data.bin layout, and the schema/metadata round trip over arbitrary schemas."""
from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import replay_payload as rp
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay_payload import PayloadStorage

from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.replay import files
from ingestd.replay.layout import WRITE_INDEX, Leaf, with_stamps

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.float32, torch.float64]


def shm_tmp():
    return tempfile.TemporaryDirectory(prefix="ingestd-prop-", dir="/dev/shm")


@SETTINGS
@given(capacity=st.integers(1, 1 << 40), data=st.data())
def test_segments_cover_the_ring_in_order(capacity, data):
    start = data.draw(st.integers(0, (1 << 62) - capacity), label="start")
    n = data.draw(st.integers(1, min(capacity, 10_000)), label="n")
    parts = ReplayStorage._segments(SimpleNamespace(capacity=capacity), start, n)
    assert 1 <= len(parts) <= 2
    slots = np.concatenate([np.arange(dst.start, dst.stop) for dst, _ in parts])
    rows = np.concatenate([np.arange(src.start, src.stop) for _, src in parts])
    assert (rows == np.arange(n)).all()
    assert (slots == (start + np.arange(n)) % capacity).all()
    assert all(0 <= dst.start < dst.stop <= capacity for dst, _ in parts)


@SETTINGS
@given(capacity=st.integers(1, 24), sizes=st.lists(st.integers(0, 24), max_size=12))
def test_fifo_overwrite_order_and_write_count(capacity, sizes):
    sizes = [min(s, capacity) for s in sizes]
    with shm_tmp() as tmp:
        with PayloadStorage.create(Path(tmp) / "r", rp.spec("cartpole"), capacity) as store:
            expected_start = 0
            for n in sizes:
                assert store.write(rp.template(store.schema, n)) == expected_start
                expected_start += n
            total = sum(sizes)
            assert store.write_count == total and len(store) == min(total, capacity)
            # the model: slot s holds the newest write index w < total with w % capacity == s
            newest = {w % capacity: w for w in range(total)}
            seq = np.array(store.seq)
            for slot in range(capacity):
                assert seq[slot] == (2 * newest[slot] + 2 if slot in newest else 0)
        with ReplayReader(Path(tmp) / "r") as reader:
            td = reader.gather(sorted(newest))
            assert td.get(WRITE_INDEX).tolist() == [newest[s] for s in sorted(newest)]
            assert not rp.bad_rows(td, reader.schema).any()


names = st.sampled_from(["obs", "next", "reward", "a", "b", "pixels"])
leaves = st.builds(Leaf, st.lists(st.integers(0, 5), max_size=3).map(tuple), st.sampled_from(DTYPES))
big_leaves = st.builds(Leaf, st.tuples(st.integers(2, 3), st.integers(32, 40), st.integers(32, 40)),  # columns
                       st.sampled_from([torch.uint8, torch.float32]))


@st.composite
def schemas(draw):
    spec = draw(st.dictionaries(st.lists(names, min_size=1, max_size=3).map(tuple),
                                st.one_of(leaves, leaves, big_leaves), max_size=6))
    keys = sorted(spec, key=len)  # a key cannot be both a leaf and a node
    spec = {k: v for k, v in spec.items() if not any(k[:len(o)] == o for o in keys if o != k)}
    return with_stamps(spec)


def check_layout(schema, capacity, layout: files.Layout) -> None:
    record = layout.record_bytes
    assert record % 8 == 0 and (record <= 64 or record % 64 == 0)
    spans = []
    for key, offset in layout.fields.items():
        leaf = schema[key]
        assert leaf.row_bytes < files.LARGE_ROW_BYTES
        assert offset % torch.empty((), dtype=leaf.dtype).element_size() == 0  # aligned
        spans.append((offset, offset + leaf.row_bytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and (not spans or spans[-1][1] <= record)
    columns = sorted((o, o + capacity * schema[k].row_bytes) for k, o in layout.columns.items())
    assert all(o % files.ALIGN == 0 for o, _ in columns)
    assert all(a[1] <= b[0] for a, b in zip(columns, columns[1:]))
    assert (columns[0][0] if columns else layout.data_bytes) >= capacity * record
    assert layout.data_bytes >= max([capacity * record] + [end for _, end in columns])
    assert set(layout.fields) | set(layout.columns) == set(schema)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas(), capacity=st.integers(1, 40), data=st.data())
def test_schema_and_metadata_round_trip(schema, capacity, data):
    check_layout(schema, capacity, files.plan_layout(schema, capacity))
    with shm_tmp() as tmp:
        path = Path(tmp) / "r"
        spec = {k: (v.shape, v.dtype) for k, v in schema.items()}
        with PayloadStorage.create(path, spec, capacity) as store:
            assert store.schema == schema
            n = data.draw(st.integers(1, capacity), label="rows")
            store.write(rp.template(schema, n))
        meta = files.read_meta(path)
        assert (meta["schema"], meta["capacity"]) == (schema, capacity)
        assert meta["layout"] == files.plan_layout(schema, capacity)
        with ReplayStorage.open(path, spec, capacity) as again:
            assert again.schema == schema and again.write_count == n
        with ReplayReader(path, seed=0) as reader:
            td = reader.gather(np.arange(n))
            assert td.get(WRITE_INDEX).tolist() == list(range(n))
            assert not rp.bad_rows(td, schema).any()
            sample = reader.sample(2 * n)
            assert not rp.bad_rows(sample, schema).any()
            for key, leaf in schema.items():
                assert sample.get(key).shape == (2 * n, *leaf.shape) and sample.get(key).dtype == leaf.dtype
