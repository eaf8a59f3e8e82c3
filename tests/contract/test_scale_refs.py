"""order_version 5: long scale lists stored once in the weights blob, read back exactly."""

from __future__ import annotations

import numpy as np
import pytest

from tandoor_contract import orders


def _order(n: int) -> dict:
    scales = [float(np.float32(x)) for x in np.random.default_rng(n).uniform(1e-4, 1e-2, n)]
    q = {"scale": scales, "zero_point": [0] * n, "axis": 0}
    return {"order_version": 2,
            "tensors": {"x": {"dtype": "int8", "shape": [1, 4], "quant": {"scale": [0.5], "zero_point": [3]}}},
            "weights": {"k": {"dtype": "int8", "shape": [n, 4], "offset": 0, "nbytes": 4 * n, "quant": q},
                        "b": {"dtype": "int32", "shape": [n], "offset": 64, "nbytes": 4 * n,
                              "quant": {**q, "scale": list(scales)}}}}


def test_long_scale_lists_move_to_the_blob_once_and_resolve_to_the_same_floats() -> None:
    order, blob = _order(40), bytes(64 + 160)
    stored, out = orders.scale_refs_out(order, blob)
    assert stored["order_version"] == orders.SCALE_REF_ORDER_VERSION == 5 and out[:len(blob)] == blob
    refs = orders.scale_refs(stored)
    assert len(refs) == 2 and refs[0] == refs[1]          # equal lists are stored once
    assert refs[0][0] % 64 == 0 and len(out) == refs[0][0] + 160
    assert stored["tensors"]["x"]["quant"]["scale"] == [0.5]   # a per-tensor scale stays inline
    back = orders.resolve_scales(stored, out)
    assert back["weights"] == order["weights"] and back["tensors"] == order["tensors"]
    for spec in back["weights"].values():
        orders.quant_of(spec)                              # a valid quant again
    assert order["weights"]["k"]["quant"]["scale"] != stored["weights"]["k"]["quant"]["scale"]  # input kept


def test_a_short_list_order_is_unchanged_and_a_bad_reference_is_refused() -> None:
    order, blob = _order(8), bytes(64 + 32)
    stored, out = orders.scale_refs_out(order, blob)
    assert stored == order and out == blob
    stored, out = orders.scale_refs_out(_order(40), bytes(224))
    with pytest.raises(ValueError, match="not float32s inside the 100-byte weights blob"):
        orders.resolve_scales(stored, out[:100])


def test_a_long_zero_point_list_of_one_value_is_a_fill_and_resolves_back() -> None:
    order, blob = _order(40), bytes(64 + 160)
    stored, out = orders.scale_refs_out(order, blob)
    assert stored["weights"]["k"]["quant"]["zero_point"] == {"fill": 0, "count": 40}
    assert stored["tensors"]["x"]["quant"]["zero_point"] == [3]           # short: inline
    assert orders.resolve_scales(stored, out)["weights"] == order["weights"]
    stored["weights"]["k"]["quant"]["zero_point"] = {"fill": "0", "count": 40}
    with pytest.raises(ValueError, match="zero_point"):
        orders.resolve_scales(stored, out)
