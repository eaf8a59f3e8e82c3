"""The probe each order is checked with at load (tandoor_contract.probe): inputs both halves make
alike, and the recorded sample read back as written."""

from __future__ import annotations

import numpy as np
import pytest

from tandoor_contract import probe

ORDER = {"inputs": [{"name": "a", "shape": [1, 8, 16, 3]}, {"name": "b", "shape": [2, 5]}]}


def test_inputs_are_unit_variance_noise_with_tails_the_same_every_time_and_distinct_per_input():
    a, b = probe.inputs(ORDER)
    assert a.shape == (1, 8, 16, 3) and b.shape == (2, 5) and a.dtype == b.dtype == np.float32
    again = probe.inputs(ORDER)
    assert a.tobytes() == again[0].tobytes() and b.tobytes() == again[1].tobytes()
    big = probe.inputs({"inputs": [{"shape": [200000]}]})[0]
    assert abs(float(big.mean())) < 0.01 and abs(float(big.var()) - 1.0) < 0.01
    assert float(np.abs(big).max()) <= 2 * np.sqrt(3) and len(np.unique(big)) > 190000
    assert 0.02 < float(np.mean(np.abs(big) > 2)) < 0.06   # tails, as a normal's 4.6% beyond 2
    assert not np.array_equal(a.reshape(-1)[:10], b.reshape(-1))   # input k has its own stream


def test_pack_keeps_small_outputs_whole_and_samples_big_ones():
    small, big = np.arange(12, dtype=np.float32).reshape(3, 4), np.random.default_rng(1).random(100000, np.float32)
    recorded = probe.unpack(probe.pack([small, big]))
    assert [len(i) for i, _ in recorded] == [12, probe.SAMPLE]
    got = probe.sampled([small, big], recorded)
    for g, (idx, values) in zip(got, recorded):
        assert np.array_equal(g, values) and np.all(np.diff(idx) > 0)
    with pytest.raises(ValueError, match="2 outputs, the probe recorded 1"):
        probe.sampled([small, big], recorded[:1])
    with pytest.raises(ValueError, match="smaller than the probe recorded"):
        probe.sampled([small, big[:10]], recorded)


def test_pack_stores_no_indices_and_keeps_integer_codes_in_their_dtype():
    import io

    codes = np.random.default_rng(2).integers(-128, 128, (1, 56, 56, 24), dtype=np.int8)
    data = probe.pack([codes])
    with np.load(io.BytesIO(data)) as z:
        assert sorted(z.files) == ["n0", "p0", "v0", "version"] and z["v0"].dtype == np.int8
    (idx, values), = probe.unpack(data)
    assert values.dtype == np.float32 and len(np.unique(idx)) == probe.SAMPLE
    assert np.array_equal(values, codes.reshape(-1)[idx].astype(np.float32))
    # spread over the whole output: every one of the 24 channels and most rows are sampled
    assert len(np.unique(idx % 24)) == 24 and len(np.unique(idx // (56 * 24))) == 56
    # a multiple of the usual multiplier still gets distinct indices
    n = 1_000_003 * 2
    assert len(np.unique(probe.sample_indices(n, probe._multiplier(n)))) == probe.SAMPLE
    assert len(data) < probe.SAMPLE * 1.2   # about a byte per code (version 1: 8)


def test_a_version_1_probe_is_still_read():
    import io

    buf = io.BytesIO()
    np.savez(buf, version=np.int64(1), i0=np.array([1, 5, 7], np.int32), v0=np.array([0.5, 1.5, 2.5], np.float32))
    (idx, values), = probe.unpack(buf.getvalue())
    assert idx.tolist() == [1, 5, 7] and values.tolist() == [0.5, 1.5, 2.5]


def test_a_member_that_is_no_probe_is_refused_in_one_line():
    for data in (b"not a zip", probe.pack([np.zeros(3, np.float32)])[:40]):
        with pytest.raises(ValueError, match="not a probe member"):
            probe.unpack(data)
    import io

    buf = io.BytesIO()
    np.savez(buf, version=np.int64(probe.PROBE_VERSION + 1), i0=np.arange(2), v0=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=f"probe version {probe.PROBE_VERSION + 1}"):
        probe.unpack(buf.getvalue())


def test_an_int8_outputs_drift_is_read_back_and_its_absence_is_none():
    codes = np.random.default_rng(3).integers(-128, 128, (1, 7, 7, 32), dtype=np.int8)
    floats = np.zeros((2, 3), np.float32)
    data = probe.pack([codes, floats], [(0.09, 44.0), None])
    assert probe.drift(data) == [(0.09, 44.0), None]
    assert [len(i) for i, _ in probe.unpack(data)] == [codes.size, 6]   # the sample is as before
    assert probe.drift(probe.pack([codes])) == [None]          # a probe without drift (every older one)
    with pytest.raises(ValueError, match="not a probe member"):
        probe.drift(b"junk")
