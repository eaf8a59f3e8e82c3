"""Quantized orders (order_version 2): a QDQ model's convolutions, dense layers and residual adds
are delegated as int8 kernels (int8 activations and weights, int32 biases), not as float32 between
dequantize and quantize. The reference is onnxruntime running the QDQ model onnxruntime's own quantizer made.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.cli import manifest_of, run_cli
from support.qdq import quantized_small_cnn
from tandoor_compiler.backends import acl
from tandoor_agent.run.executors import armnn_tflite
from tandoor_contract import hmod, orders, probe

RNG = np.random.default_rng(20261202)


@pytest.fixture(scope="module", params=[("per-channel", "int8"), ("per-tensor", "int8"), ("per-channel", "uint8")],
                ids=lambda p: "-".join(p))
def qdq(request, tmp_path_factory) -> tuple[str, str, object]:
    """The small CNN quantized by onnxruntime (QDQ, int8 weights) and compiled with every region
    delegated: (weights, activations, paths)."""
    weights, acts = request.param
    d = tmp_path_factory.mktemp("qdq")
    fp32, q = quantized_small_cnn(d, per_channel=weights == "per-channel", activations=acts)
    out = d / "small.qdq.hmod"
    res = run_cli("tandoor", "compile", str(q), "-o", str(out), "-q", "--policy", "all", "--measure", "off")
    assert res.returncode == 0, res.stderr
    return weights, acts, {"fp32": fp32, "qdq": q, "hmod": out}


def _quantized_orders(path) -> list[dict]:
    b = hmod.open_bundle(path)
    return [b.order(p["symbol"]) for p in b.manifest["partitions"] if p["delegate"]
            and b.order(p["symbol"])["order_version"] in (orders.QUANT_ORDER_VERSION, orders.SCALE_REF_ORDER_VERSION)]


def test_int8_grid_recovers_the_codes_and_scales_of_a_folded_dequantize():
    codes = RNG.integers(-128, 128, (16, 3, 3, 8)).astype(np.int8)
    scales = RNG.uniform(1e-3, 1e-1, 16).astype(np.float32)
    folded = codes.astype(np.float32) * scales[:, None, None, None]       # what FoldConstant leaves
    got, q = acl.weight_grid(folded, 0)
    assert q.axis == 0 and len(q.scale) == 16 and got.dtype == np.int8
    back = got.astype(np.float64) * np.asarray(q.scale)[:, None, None, None]
    np.testing.assert_allclose(back, folded, rtol=1e-6, atol=0)
    # one scale for the whole tensor when one fits (what Arm NN's bindings take)
    got, q = acl.weight_grid(codes.astype(np.float32) * np.float32(0.02), 0)
    assert q.axis is None and np.abs(got.astype(np.float64) * q.scale[0] - codes * 0.02).max() < 1e-6
    # a float weight is no grid: such a conv stays a float one
    assert acl.weight_grid(RNG.standard_normal((16, 3, 3, 8)).astype(np.float32), 0) is None


def test_the_convs_and_the_dense_layer_become_int8_orders(qdq):
    weights, acts, paths = qdq
    qorders = _quantized_orders(paths["hmod"])
    ops = [op for o in qorders for op in o["ops"]]
    assert sorted(op["type"] for op in ops) == ["binary", "conv2d", "conv2d", "conv2d", "dense"]
    # the residual add is an int8 add of two int8 tensors, inside the convolutions' order: the
    # block is one order, not three
    (add,) = [op for op in ops if op["type"] == "binary"]
    assert add["attrs"]["kind"] == "add" and len(add["inputs"]) == 2 and not add.get("weights")
    (block,) = [o for o in qorders if add in o["ops"]]
    assert [op["type"] for op in block["ops"]] == ["conv2d", "conv2d", "conv2d", "binary"]
    for o in qorders:
        for n, t in o["tensors"].items():
            assert t["dtype"] == acts and len(orders.quant_of(t, n).scale) == 1
    weighted = [op for o in qorders for op in o["ops"] if op["type"] != "binary"]
    kernels = [o["weights"][op["weights"]["kernel"]] for o in qorders for op in o["ops"] if op in weighted]
    biases = [o["weights"][op["weights"]["bias"]] for o in qorders for op in o["ops"] if op in weighted]
    assert all(k["dtype"] == "int8" and k["nbytes"] == int(np.prod(k["shape"])) for k in kernels)
    assert all(b["dtype"] == "int32" for b in biases)
    per_axis = {orders.quant_of(k).axis is not None for k in kernels}
    assert per_axis == ({True} if weights == "per-channel" else {False})
    # per channel: the agent makes each such order's per-axis quantization for Arm NN's TfLite
    # parser from the order (scales only, a few KB); the bundle holds nothing for it
    with hmod.open_bundle(paths["hmod"]) as b:
        assert not any(p.get("tflite") for p in b.manifest["partitions"])
        assert not any(n.endswith(".tflite") for n in b.members)
        models = {o["symbol"]: armnn_tflite.quant_model(b.order(o["symbol"])) for o in qorders}
    assert all((m is not None) == (weights == "per-channel") for m in models.values())
    assert all(len(m) < 4096 for m in models.values() if m)
    man = manifest_of(paths["hmod"])
    conv_flops = 2 * (16 * 16 * 16 * 27 + 16 * 16 * 16 * 9 + 16 * 16 * 16 * 16) + 2 * 16 * 10
    add_flops = 4 * 16 * 16 * 16   # the residual add: two dequantizes, the add, the quantize
    # the MACs, and the elementwise work riding along (bias, dequantize, quantize: one per element)
    assert conv_flops + add_flops <= man["flops_delegated_int8"] <= 1.1 * conv_flops + add_flops
    assert "int8 kernels for" in man["quantized"]["compute"]
    # the TVM fallbacks take the orders' int8 bytes: the kernels are stored once, as int8
    b = hmod.open_bundle(paths["hmod"])
    fb = [f for p in b.manifest["partitions"] for f in p.get("fallback_params", [])]
    shapes = {tuple(k["shape"]) for k in kernels}
    as_kernels = [f for f in fb if tuple(f["shape"]) in shapes]
    assert len(as_kernels) == len(kernels)
    assert all(f["dtype"] == "int8" and f["member"].startswith("orders/") for f in as_kernels)


@pytest.mark.parametrize("delegate", ["onnxruntime", "armnn", "tvm"])
def test_the_int8_bundle_matches_onnxruntimes_int8_run_on_each_executor(qdq, delegate):
    """verify against the QDQ model in onnxruntime within the manifest's tolerance (quantization
    steps); Arm NN (CpuRef here) runs per-tensor and per-channel orders alike (the latter's per-axis
    scales from the TFLite model the agent makes of the order), which verify's executor report says."""
    weights, acts, paths = qdq
    res = run_cli("tandoor", "verify", str(paths["hmod"]), "--reference", str(paths["qdq"]), "--delegate", delegate,
                  "--json", env={"TANDOOR_ARMNN_CHECK": "all"})
    rep = json.loads(res.stdout)
    assert res.returncode == 0 and rep["ok"] and rep["max_abs_err"] <= rep["atol"], res.stdout + res.stderr
    quantized = {o["symbol"] for o in _quantized_orders(paths["hmod"])}
    ran = {sg["symbol"]: sg["executor"] for sg in rep["subgraphs"] if sg["symbol"] in quantized}
    assert ran == {s: delegate for s in quantized}, rep["subgraphs"]
    step = manifest_of(paths["hmod"])["quantized"]["steps"]["logits"]
    assert rep["atol"] <= 5 * step


def test_per_channel_scales_are_stored_once_in_the_blob_for_every_reader(qdq):
    """order_version 5: the order JSON refers to its per-channel scales in the weights blob, the
    ONNX rendering reads them there as external data, and the TVM fallback's scale parameters are
    ranges of the same blob; Bundle.order gives them back as the lists they were."""
    import onnx

    weights, acts, paths = qdq
    b = hmod.open_bundle(paths["hmod"])
    for p in b.manifest["partitions"]:
        if not p["delegate"]:
            continue
        raw = json.loads(b.read(p["order"]))
        refs = orders.scale_refs(raw)
        assert bool(refs) == (raw["order_version"] == 5)
        if weights == "per-channel" and any(op["type"] == "conv2d" for op in raw["ops"]):
            assert refs, raw["symbol"]                 # 16 channels: at least SCALE_REF_MIN
        order = b.order(p["symbol"])
        for spec in list(order["weights"].values()) + list(order["tensors"].values()):
            orders.quant_of(spec)                      # resolved: lists again
        model = onnx.ModelProto()
        model.ParseFromString(b.read(p["onnx"]))
        inline = [t.name for t in model.graph.initializer
                  if t.data_location != onnx.TensorProto.EXTERNAL and t.data_type == onnx.TensorProto.FLOAT
                  and len(t.dims) == 1 and t.dims[0] >= orders.SCALE_REF_MIN]
        assert inline == []                            # no per-channel scale copied into the rendering
        zps = [t.name for t in model.graph.initializer if t.name.endswith("__zp") and len(t.dims) == 1
               and t.dims[0] >= orders.SCALE_REF_MIN and t.data_location != onnx.TensorProto.EXTERNAL]
        assert zps == []                               # nor its zero points: the zeros the blob ends with
        zero_params = [f for f in p["fallback_params"] if f["member"] != p["weights"] and f["dtype"] == "int8"]
        assert zero_params == []
        at = {off for off, _ in refs}
        fb_scales = [f for f in p["fallback_params"] if f["dtype"] == "float32" and f["offset"] in at
                     and f["member"] == p["weights"]]
        assert bool(fb_scales) == bool(refs)


def test_the_tvm_side_keeps_int8_kernels_once_for_every_target(tmp_path):
    """Nothing delegated (--policy none): the TVM main module computes the whole QDQ model, and its
    weights are not in the libraries but in one lib_params member both targets read, the quantized
    kernels as their int8 codes (format 4); the bundle still matches onnxruntime's int8 run, and a
    lib_params range that does not fit is refused in one line."""
    _, q = quantized_small_cnn(tmp_path, per_channel=True, activations="int8")   # one quantization is enough
    paths = {"qdq": q}
    out = tmp_path / "tvm.hmod"
    res = run_cli("tandoor", "compile", str(paths["qdq"]), "-o", str(out), "-q", "--policy", "none",
                  "--target", "aarch64", "--measure", "off")
    assert res.returncode == 0, res.stderr
    man = manifest_of(out)
    assert man["format_version"] == 4 and not any(p["delegate"] for p in man["partitions"])
    specs = {t: v["lib_params"] for t, v in man["targets"].items()}
    assert set(specs) == {"host", "aarch64"} and specs["host"] == specs["aarch64"]
    assert {s["member"] for s in specs["host"]} == {hmod.LIB_PARAMS}
    kernels = [s for s in specs["host"] if s["dtype"] == "int8" and len(s["shape"]) >= 2]
    assert len(kernels) == 4, specs["host"]            # three convs and the dense layer, as int8 codes
    rep = run_cli("tandoor", "verify", str(out), "--reference", str(paths["qdq"]), "--json")
    v = json.loads(rep.stdout)
    assert rep.returncode == 0 and v["ok"] and v["max_abs_err"] <= v["atol"], rep.stdout + rep.stderr

    from support.bundle_edit import rewrite

    def grow(manifest, members):
        for t in manifest["targets"].values():
            t["lib_params"][0]["nbytes"] += 1
    bad = rewrite(out, tmp_path / "bad.hmod", grow)
    res = run_cli("tandoor-agent", "run", str(bad))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert "lib_params[0]" in res.stderr and "recompile the model" in res.stderr, res.stderr


def test_each_int8_orders_probe_records_its_rounding_drift(qdq):
    """The load-time check of a deep INT8 order allows what one requantization in twenty rounding
    the other way did to its output at compile time (tandoor_contract.probe.drift)."""
    weights, acts, paths = qdq
    with hmod.open_bundle(paths["hmod"]) as b:
        drifts = {p["symbol"]: probe.drift(b.read(p["probe"])) for p in b.manifest["partitions"]
                  if p["delegate"] and orders.is_quantized(b.order(p["symbol"]))}
    assert drifts and all(len(d) == 1 and d[0] is not None for d in drifts.values()), drifts
    assert all(0.0 <= d[0][0] <= 1.0 and 0.0 <= d[0][1] <= 255.0 for d in drifts.values()), drifts


def test_a_bias_code_at_int32s_end_leaves_room_for_the_accumulator(tmp_path):
    """A channel whose weights are all but zero beside a real bias (EfficientNet-Lite0's stem has
    two): its int32 bias code sat at int32's end, and ACL's wrapping int32 sum of bias and
    accumulator gave +14/+22 steps on CpuAcc where the reference clamps. The order's bias codes
    leave room for any accumulator; the bundle still agrees with onnxruntime."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    xs, ys = np.float32(0.02), np.float32(0.05)
    ws = np.linspace(0.005, 0.02, 8).astype(np.float32)      # per channel: no one scale fits them
    ws[3] = 1e-9                                              # a dead channel
    w = rng.integers(-127, 128, (8, 4, 3, 3)).astype(np.int8)
    b = np.round(rng.normal(0, 0.5, 8) / (xs * ws)).clip(-2 ** 31, 2 ** 31 - 1).astype(np.int32)
    b[3] = -2 ** 31 + 5                                       # its bias: int32's end
    w2 = rng.integers(-127, 128, (8, 8, 1, 1)).astype(np.int8)   # a second conv: the first's output stays NHWC
    inits = [numpy_helper.from_array(a, n) for n, a in {
        "xs": xs, "xz": np.int8(0), "ys": ys, "yz": np.int8(-128), "w": w, "ws": ws, "wz": np.zeros(8, np.int8),
        "b": b, "bs": (xs * ws).astype(np.float32), "bz": np.zeros(8, np.int32), "w2": w2, "w2s": np.float32(0.01),
        "w2z": np.int8(0), "zs": np.float32(0.1), "zz": np.int8(0)}.items()]
    N = helper.make_node
    nodes = [N("QuantizeLinear", ["x", "xs", "xz"], ["xq"]), N("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             N("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0), N("DequantizeLinear", ["b", "bs", "bz"], ["bd"], axis=0),
             N("Conv", ["xd", "wd", "bd"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["r"]),
             N("QuantizeLinear", ["r", "ys", "yz"], ["yq"]), N("DequantizeLinear", ["yq", "ys", "yz"], ["yd"]),
             N("DequantizeLinear", ["w2", "w2s", "w2z"], ["w2d"]), N("Conv", ["yd", "w2d"], ["c2"]),
             N("QuantizeLinear", ["c2", "zs", "zz"], ["zq"]), N("DequantizeLinear", ["zq", "zs", "zz"], ["y"])]
    g = helper.make_graph(nodes, "dead_channel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    model = tmp_path / "dead.qdq.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(model))
    out = tmp_path / "dead.hmod"
    res = run_cli("tandoor", "compile", str(model), "-o", str(out), "-q", "--policy", "all", "--measure", "off")
    assert res.returncode == 0, res.stderr
    (order,) = _quantized_orders(out)
    with hmod.open_bundle(out) as bundle:
        part = [p for p in bundle.manifest["partitions"] if p["delegate"]][0]
        blob = bundle.read(part["weights"])
    conv = order["ops"][0]
    spec = order["weights"][conv["weights"]["bias"]]
    codes = np.frombuffer(blob, "<i4", count=8, offset=spec["offset"])
    room = 2 ** 31 - 1 - 4 * 3 * 3 * 128 * 255
    assert int(np.abs(codes.astype(np.int64)).max()) <= room and codes[3] == -room
    res = run_cli("tandoor", "verify", str(out), "--reference", str(model), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["ok"], res.stdout + res.stderr
