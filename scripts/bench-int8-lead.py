#!/usr/bin/env python3
"""Does int8 pay for a model's first convolutions on this host's onnxruntime? The measurements
behind compiler/int8/quantize.py's FP32_LEAD_BY_ARCH (docs/int8.md, "The fp32 lead").

Each row is one convolution of the shapes a model starts with, timed two ways that both end in a
quantized tensor, as the layer after it wants:
  fp32: the fp32 conv (and its Clip), then QuantizeLinear of its output
  int8: QuantizeLinear of its input, then the QDQ conv (onnxruntime fuses it into QLinearConv)
A ratio int8/fp32 above 1 means int8 costs time there.

    .venv/bin/python scripts/bench-int8-lead.py [--threads 2] [--rounds 6] [--runs 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# (kind, input channels, output channels, kernel, stride, input size): stems of MobileNet/EfficientNet
# (3x3), a 5x5 one, ResNet's 7x7, a grayscale one; depthwise convs of the sizes that follow them
CASES = [("stem", 3, 16, 3, 2, 224), ("stem", 3, 32, 3, 2, 224), ("stem", 3, 64, 3, 2, 224),
         ("stem", 3, 24, 3, 2, 320), ("stem", 3, 32, 5, 2, 224), ("stem", 3, 32, 7, 2, 224),
         ("stem", 3, 64, 7, 2, 224), ("stem", 1, 32, 3, 2, 224), ("stem", 3, 16, 3, 1, 224),
         ("depthwise", 16, 16, 3, 1, 112), ("depthwise", 32, 32, 3, 1, 112), ("depthwise", 64, 64, 3, 1, 112),
         ("depthwise", 32, 32, 3, 2, 112), ("depthwise", 32, 32, 5, 1, 112), ("depthwise", 96, 96, 3, 1, 56)]


def conv_model(cin: int, cout: int, k: int, stride: int, size: int, group: int, int8: bool,
               rng: np.random.Generator) -> bytes:
    w = (rng.standard_normal((cout, cin // group, k, k)) * 0.1).astype(np.float32)
    b = (rng.standard_normal(cout) * 0.1).astype(np.float32)
    ws = (np.abs(w).reshape(cout, -1).max(1) / 127).astype(np.float32)
    x_scale, y_scale = 0.02, 6 / 255
    inits = {"xs": np.array(x_scale, np.float32), "xz": np.array(128, np.uint8), "ys": np.array(y_scale, np.float32),
             "yz": np.array(0, np.uint8), "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    conv = dict(kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=group)
    N = helper.make_node
    if int8:      # onnxruntime's quantizer's QDQ form: symmetric per-channel weights, int32 bias
        inits.update(wq=np.clip(np.round(w / ws[:, None, None, None]), -127, 127).astype(np.int8), ws=ws,
                     wz=np.zeros(cout, np.int8), bq=np.round(b / (ws * x_scale)).astype(np.int32),
                     bs=(ws * x_scale).astype(np.float32), bz=np.zeros(cout, np.int32))
        nodes = [N("QuantizeLinear", ["x", "xs", "xz"], ["xq"]), N("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
                 N("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
                 N("DequantizeLinear", ["bq", "bs", "bz"], ["bd"], axis=0), N("Conv", ["xd", "wd", "bd"], ["c"], **conv)]
    else:
        inits.update(w=w, b=b)
        nodes = [N("Conv", ["x", "w", "b"], ["c0"], **conv), N("Clip", ["c0", "lo", "hi"], ["c"])]
    nodes += [N("QuantizeLinear", ["c", "ys", "yz"], ["yq"]), N("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    g = helper.make_graph(nodes, "lead", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return m.SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads (default 2)")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds of the two models (default 6)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs of each model per round (default 20)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for kind, cin, cout, k, stride, size in CASES:
        group = cin if kind == "depthwise" else 1
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = a.threads
        opts.log_severity_level = 3
        sessions = {tag: ort.InferenceSession(conv_model(cin, cout, k, stride, size, group, tag == "int8", rng), opts,
                                              providers=["CPUExecutionProvider"]) for tag in ("fp32", "int8")}
        x = rng.uniform(0, 5, (1, cin, size, size)).astype(np.float32)
        times: dict[str, list[float]] = {tag: [] for tag in sessions}
        for _ in range(a.rounds):
            for tag, s in sessions.items():
                for _ in range(3):
                    s.run(None, {"x": x})
                for _ in range(a.runs):
                    t = time.perf_counter()
                    s.run(None, {"x": x})
                    times[tag].append(time.perf_counter() - t)
        med = {tag: float(np.median(v)) * 1e3 for tag, v in times.items()}
        rows.append({"kind": kind, "cin": cin, "cout": cout, "kernel": k, "stride": stride, "size": size,
                     "fp32_ms": round(med["fp32"], 3), "int8_ms": round(med["int8"], 3),
                     "ratio": round(med["int8"] / med["fp32"], 2)})
        if not a.json:
            r = rows[-1]
            print(f"{kind:9} {cin:3}->{cout:<3} {k}x{k}/{stride} at {size}: fp32 + quantize {r['fp32_ms']:.3f} ms, "
                  f"quantize + int8 {r['int8_ms']:.3f} ms, int8/fp32 {r['ratio']:.2f}", flush=True)
    if a.json:
        print(json.dumps({"threads": a.threads, "onnxruntime": ort.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
