"""The GPU check (docs/gpu.md), the two halves of scripts/gpu-check.sh.

``prepare`` (this workstation, no GPU): compiles the check's models (zoo models and the real
detectors) with ``--target cuda-sm90 --policy none`` and one with ``--target jetson-orin``, checks
each GPU library's cubins by their ELF headers (sm_90, sm_87), runs each bundle here through its CPU
fallback against onnxruntime (``check``), records a random input and onnxruntime's CPU outputs for
it, and stages what the GPU machine lacks (the runtime-only TVM pieces, tvm-ffi for its Python,
libcudart.so.13, cryptography) beside the bundles in DIR, under the carried budget (64 MiB): a model
that does not fit is left out and named.

``run`` (the GPU machine: x86_64, NVIDIA GPU, CUDA 13 driver, Python 3.12 with numpy, onnxruntime
and torch, no TVM, no network): loads the staged pieces, runs every bundle with the agent's own
runtime (tandoor_agent.run.runtime, TVM's runtime only), requires its GPU part to run, checks the
outputs (golden pairs and the random input) within the bundle's promise, times it against its own
CPU library and against torch's eager run of the same network where torch has it, and writes one
markdown table (OUT/gpu-table.md) naming the machine, for docs/gpu.md.

``check BUNDLE [MODEL]``: the compile half's checks on one bundle (cubins, the CPU fallback's outputs
and its "gpu: unavailable" line); the suite runs it (tests/compiler/test_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 60 << 20          # of the 64 MiB that travel: the rest for the tree's own files
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
GPU_PYTHON = "3.12"
# (name, how to get the ONNX file, torch's eager net: ("zoo", class, seed offset, kwargs) or None), in
# the order they are carried while the budget lasts; a wild model's input pins are its WildModel's
MODELS = [
    ("mobilenet_v2", "zoo:mobilenet_v2", ("zoo", "MobileNetV2", 1, {})),
    ("yolov8n_320", "wild:yolov8n_320", None),
    ("resnet18_half", "zoo:resnet18", ("zoo", "ResNet18", 2, {"base": 32})),
    ("centerface", "wild:centerface", None),
    ("ppocr_det", "wild:ppocr_det", None),
    ("squeezenet11", "zoo:squeezenet11", None),
    ("picodet_layout", "wild:picodet_layout", None),
    ("efficientnet_lite0", "zoo:efficientnet_lite0", None),
    ("yolox_det", "wild:yolox_det", None),
]
TORCHVISION_ONLY = [("resnet50", "ResNet-50 (torchvision): not carried, its 98 MB of weights exceed the payload")]


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


# ------------------------------------------------------------------------------ the compile half

def _onnx(source: str) -> tuple[Path, list[str]]:
    """The model file and its input pins."""
    kind, name = source.split(":")
    if kind == "zoo":
        from tandoor_zoo import models
        return getattr(models, name)(), []
    from tandoor_zoo import wild
    return wild.fetch(name), list(wild.MODELS[name].inputs)


def random_inputs(manifest: dict) -> list:
    """The check's random input, made alike on both machines (only the references travel)."""
    import numpy as np

    from tandoor_contract import probe

    rng = np.random.default_rng(11)
    return [probe.random_input(rng, i) for i in manifest["inputs"]]


def _reference(model: Path, manifest: dict):
    """onnxruntime's CPU session of ``model`` as the compiler read it (normalised, its inputs pinned
    to the bundle's shapes: a placeholder input shape in the file would refuse the real one)."""
    import onnxruntime as ort

    from tandoor_compiler.stages import frontend

    pins = [f"{i['name']}=" + "x".join(str(d) for d in i["shape"]) for i in manifest["inputs"]]
    proto = frontend.load(model, pins).proto
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def check(bundle: Path, model: Path | None = None) -> dict:
    """The compile half on one bundle: every GPU library's cubins are for its SM (ELF header), and
    the bundle runs here through its CPU library, saying why the GPU part did not run, with outputs
    within its promise (golden pairs; and ``model``'s onnxruntime outputs on a random input)."""

    from tandoor_agent.run.runtime import HybridModule
    from tandoor_contract import agreement, gpu, hmod

    out = {"bundle": bundle.name, "cubins": {}}
    with hmod.open_bundle(bundle) as b:
        for t, entry in b.manifest["targets"].items():
            part = gpu.entry_of(entry)
            for sm, member in sorted((part or {}).get("libs", {}).items()):
                found = gpu.cubins(b.library(member))
                if not found or any(s != sm for s, _ in found):
                    raise SystemExit(f"{bundle.name}: {t}'s {sm} library carries cubins for {found}")
                out["cubins"][f"{t}/{sm}"] = sum(n for _, n in found)
        if not out["cubins"]:
            raise SystemExit(f"{bundle.name}: no GPU part")
        module = HybridModule(b)
        try:
            out["gpu"] = module.gpu()
            cases = [(ins, want, t) for (ins, want), t in zip(b.golden(), agreement.golden_ties(b) or [None] * 9)]
            if model is not None:
                ins = random_inputs(b.manifest)
                sess = _reference(model, b.manifest)
                cases.append((ins, sess.run(None, {i["name"]: a for i, a in zip(b.manifest["inputs"], ins)}), None))
            for ins, want, ties in cases:
                v = agreement.compare(module.run(ins), want, b.manifest, agreement.path_of(module.describe()), ties)
                if not v.ok:
                    raise SystemExit(f"{bundle.name}: the CPU fallback misses: {v.reason}")
        finally:
            module.close()
    if not (out["gpu"] or "").startswith("unavailable ("):
        raise SystemExit(f"{bundle.name}: without a GPU the runtime says gpu {out['gpu']!r}")
    return out


def _pack_tree(src: Path, dest: Path, skip) -> None:
    with tarfile.open(dest, "w:xz") as tar:
        for f in sorted(src.rglob("*")):
            rel = f.relative_to(src.parent)
            if f.is_file() and not skip(f.relative_to(src)):
                tar.add(f, arcname=str(rel))


def _stage_runtime(rt: Path, python: str = GPU_PYTHON) -> None:
    """What the GPU machine lacks, for its Python: the TVM package with only its runtime libraries,
    tvm-ffi's wheel for Python 3.12, libcudart.so.13, cryptography (abi3) for the bundle's signature."""
    import cryptography
    import tvm

    rt.mkdir(parents=True, exist_ok=True)
    tvm_dir = Path(tvm.__file__).parent
    keep_libs = {"libtvm_runtime.so", "libtvm_runtime_cuda.so"}
    _pack_tree(tvm_dir, rt / "tvm.tar.xz", lambda r: r.parts[0] in ("3rdparty", "src", "web", "include")
               or "__pycache__" in r.parts or (r.parts[0] == "lib" and r.name not in keep_libs))
    _pack_tree(Path(cryptography.__file__).parent, rt / "cryptography.tar.xz", lambda r: "__pycache__" in r.parts)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--python-version",
                    python, "--platform", "manylinux_2_28_x86_64", TVM_FFI, "-d", str(rt)], check=True,
                   capture_output=True)
    cudart = next(Path(p) / "nvidia" / "cu13" / "lib" / "libcudart.so.13" for p in sys.path
                  if (Path(p) / "nvidia" / "cu13" / "lib" / "libcudart.so.13").is_file())
    shutil.copy(cudart, rt / "libcudart.so.13")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prepare(out: Path, budget: int = BUDGET, names: list[str] | None = None, python: str = GPU_PYTHON) -> dict:
    import numpy as np

    from tandoor_compiler.pipeline import compile_model
    from tandoor_contract import hmod

    if out.exists():
        shutil.rmtree(out)
    (out / "bundles").mkdir(parents=True)
    say("staging the runtime-only TVM pieces")
    _stage_runtime(out / "runtime", python)
    plan = {"models": [], "left_out": [], "sm_87": None}
    for name, source, torch_net in MODELS:
        if names and name not in names:
            continue
        model, pins = _onnx(source)
        if _size(out) + model.stat().st_size > budget:    # its weights alone would not fit: not compiled
            plan["left_out"].append(f"{name} (its {model.stat().st_size / 2**20:.1f} MiB of ONNX: past the "
                                    f"{budget >> 20} MiB payload)")
            continue
        bundle = out / "bundles" / f"{name}.hmod"
        say(f"{name}: compiling for cuda-sm90")
        t0 = time.monotonic()
        try:
            compile_model(model, bundle, targets=["cuda-sm90"], inputs=pins, policy="none", measure="off")
        except Exception as err:     # named in the plan; the others still go
            plan["left_out"].append(f"{name} (the compile failed: {' '.join(str(err).split())[:200]})")
            continue
        seconds = time.monotonic() - t0
        facts = check(bundle, model)
        if _size(out) > budget:
            plan["left_out"].append(f"{name} ({bundle.stat().st_size / 2**20:.1f} MiB: past the {budget >> 20} MiB payload)")
            bundle.unlink()
            continue
        with hmod.open_bundle(bundle) as b:
            ins = random_inputs(b.manifest)
            names_in = [i["name"] for i in b.manifest["inputs"]]
            want = _reference(model, b.manifest).run(None, dict(zip(names_in, ins)))
        np.savez_compressed(out / "bundles" / f"{name}.ref.npz", **{f"out{j}": a for j, a in enumerate(want)})
        plan["models"].append({"name": name, "source": source, "torch": torch_net, "compile_s": round(seconds, 1),
                               "bytes": bundle.stat().st_size, **facts})
    first = next((m for m in plan["models"]), None)
    if first is not None:     # the Jetson's SM: compiled and checked here, not carried
        with tempfile.TemporaryDirectory() as td:
            bundle = Path(td) / "orin.hmod"
            model, pins = _onnx(first["source"])
            compile_model(model, bundle, targets=["jetson-orin"], inputs=pins, measure="off")
            plan["sm_87"] = check(bundle)
    plan["payload_bytes"] = _size(out)
    (out / "plan.json").write_text(json.dumps(plan, indent=2))
    say(f"staged {len(plan['models'])} model(s), {plan['payload_bytes'] / 2**20:.1f} MiB in {out}"
        + (f"; left out: {', '.join(plan['left_out'])}" if plan["left_out"] else ""))
    return plan


# ------------------------------------------------------------------------------ the GPU half

def _unpack_runtime(rt: Path, site: Path) -> None:
    for tar in ("tvm.tar.xz", "cryptography.tar.xz"):
        with tarfile.open(rt / tar) as t:
            t.extractall(site, filter="data")
    wheel = next(rt.glob("apache_tvm_ffi-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for name, folder in (("tandoor_contract", "contract"), ("tandoor_agent", "agent"), ("tandoor_zoo", "zoo")):
        (site / name).symlink_to(ROOT / folder)
    lib = site / "nvidia" / "cu13" / "lib"       # where agent/run/gpu.py looks for libcudart.so.13
    lib.mkdir(parents=True)
    shutil.copy(rt / "libcudart.so.13", lib / "libcudart.so.13")


def _median_ms(f, runs: int, warmup: int = 5) -> tuple[float, float]:
    import numpy as np

    for _ in range(warmup):
        f()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times)), float(np.percentile(times, 90))


def run_bundles(staged: Path, runs: int) -> list[dict]:
    """In this process (TVM's runtime only, torch kept out): every bundle on the GPU, then on its
    CPU library (TANDOOR_GPU=0), its outputs judged against the recorded references."""
    import numpy as np

    from tandoor_agent.run.runtime import HybridModule
    from tandoor_contract import agreement, hmod

    rows = []
    for m in json.loads((staged / "plan.json").read_text())["models"]:
        row = {"name": m["name"], "torch": m["torch"]}
        path = staged / "bundles" / f"{m['name']}.hmod"
        ref = np.load(staged / "bundles" / f"{m['name']}.ref.npz")
        with hmod.open_bundle(path) as b:
            cases = [(ins, want, t) for (ins, want), t in zip(b.golden(), agreement.golden_ties(b) or [None] * 9)]
            cases.append((random_inputs(b.manifest), [ref[f"out{j}"] for j in range(len(b.manifest["outputs"]))],
                          None))
            row["input"] = " ".join("x".join(map(str, i["shape"])) for i in b.manifest["inputs"])
            for where in ("gpu", "cpu"):
                os.environ["TANDOOR_GPU"] = "1" if where == "gpu" else "0"
                module = HybridModule(b)
                try:
                    row[f"{where}_said"] = module.gpu()
                    if where == "gpu":
                        worst, misses = 0.0, []
                        for ins, want, ties in cases:
                            v = agreement.compare(module.run(ins), want, b.manifest,
                                                  agreement.path_of(module.describe()), ties)
                            worst = max(worst, v.max_abs_err)
                            misses += [v.reason] if not v.ok else []
                        if not (row["gpu_said"] or "").startswith("cuda "):
                            misses.insert(0, "its GPU part did not run")
                        row.update(max_abs_err=worst, ok=not misses,
                                   misses=misses, atol=agreement.tolerance(b.manifest.get("tolerance"), "", "").atol)
                    x = cases[-1][0]
                    row[f"{where}_ms"] = _median_ms(lambda m=module, x=x: m.run(x),
                                                    runs if where == "gpu" else max(3, runs // 10))
                finally:
                    module.close()
        say(f"{m['name']}: {row['gpu_said']}, max abs err {row['max_abs_err']:.3g}, "
            f"GPU {row['gpu_ms'][0]:.2f} ms, CPU lib {row['cpu_ms'][0]:.1f} ms")
        rows.append(row)
    return rows


_TORCH = """
import json, sys, time
import torch
spec, shape, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
if spec[0] == "zoo":
    from tandoor_zoo import models
    net = models._torch_nets()[spec[1]](**spec[3])
    models._init_weights(net, models._SEED + spec[2], tuple(shape))
else:
    import torchvision
    net = getattr(torchvision.models, spec[1])()
net = net.eval().cuda()
x = torch.randn(*shape, device="cuda")
with torch.no_grad():
    for _ in range(10):
        net(x)
    torch.cuda.synchronize()
    t = []
    for _ in range(runs):
        t0 = time.perf_counter(); net(x); torch.cuda.synchronize(); t.append((time.perf_counter() - t0) * 1e3)
t.sort()
print(json.dumps({"ms": t[len(t) // 2], "torch": torch.__version__}))
"""


def torch_eager(site: Path, spec, shape, runs: int) -> dict:
    """torch's eager run of the same network on the GPU, fp32 (a process of its own: the bundle's
    keeps torch out, as the agent does)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run([sys.executable, "-c", _TORCH, json.dumps(spec), json.dumps(shape), str(runs)],
                         capture_output=True, text=True, env=env, timeout=300)
    if res.returncode != 0:
        return {"note": " ".join((res.stderr or "failed").strip().splitlines()[-1:])[:160]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        smi = "nvidia-smi not found"
    return f"{smi}; {cpu}; Python {platform.python_version()}"


def table(rows: list[dict], machine: str, torchvision_note: str) -> str:
    lines = [f"Measured {time.strftime('%Y-%m-%d', time.gmtime())} on {machine} by `scripts/gpu-check.sh run` "
             "(bundles compiled on the workstation with `--target cuda-sm90 --policy none`; latency: median "
             "of one image, batch 1, fp32, inputs copied in and outputs out on every run).", "",
             "| model | input | GPU part | outputs within promise (max abs err / atol) | Tandoor GPU ms | "
             "Tandoor CPU lib ms | torch eager GPU ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = ("yes" if r["ok"] else "NO: " + "; ".join(r["misses"])[:120]) + f" ({r['max_abs_err']:.2g} / {r['atol']:.2g})"
        t = r.get("torch_ms")
        eager = f"{t:.2f}" if t is not None else f"- ({r['torch_note']})" if r.get("torch_note") else "-"
        lines.append(f"| {r['name']} | {r['input']} | {r['gpu_said']} | {verdict} | {r['gpu_ms'][0]:.2f} | "
                     f"{r['cpu_ms'][0]:.1f} | {eager} |")
    if torchvision_note:
        lines += ["", torchvision_note]
    return "\n".join(lines) + "\n"


def run(staged: Path, out: Path, runs: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="tandoor-gpu-check-"))
    _unpack_runtime(staged / "runtime", site)
    sys.path.insert(0, str(site))
    from tandoor_agent.run import lean

    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    lean.tvm_without_torch()
    rows = run_bundles(staged, runs)
    for r in rows:
        if r["torch"]:
            got = torch_eager(site, r["torch"], [int(d) for d in r["input"].split("x")], runs)
            r["torch_ms"], r["torch_note"] = got.get("ms"), got.get("note")
    note = ""
    for name, why in TORCHVISION_ONLY:
        got = torch_eager(site, ["torchvision", name], [1, 3, 224, 224], runs)
        note += (f"{why}; torch eager on this GPU: {got['ms']:.2f} ms. " if "ms" in got
                 else f"{why}; torchvision is not installed here, so no torch column for it ({got['note']}). ")
    md = table(rows, _machine(), note.strip())
    (out / "gpu-table.md").write_text(md)
    (out / "gpu-check.json").write_text(json.dumps(rows, indent=2, default=str))
    print(md)
    return 0 if rows and all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="compile, check and stage (the workstation)")
    p.add_argument("--dir", type=Path, default=ROOT / ".gpu-check")
    p.add_argument("--budget-mib", type=int, default=BUDGET >> 20)
    p.add_argument("--model", action="append", help="only these (names of MODELS)")
    p.add_argument("--python", default=GPU_PYTHON, help="the GPU machine's Python (tvm-ffi's wheel is per version; "
                   "this machine's own for a dry run of 'run' here)")
    r = sub.add_parser("run", help="run the staged bundles on this machine's GPU")
    r.add_argument("--dir", type=Path, default=ROOT / ".gpu-check")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / ".gpu-check" / "out")))
    r.add_argument("--runs", type=int, default=50)
    c = sub.add_parser("check", help="the compile half's checks on one bundle")
    c.add_argument("bundle", type=Path)
    c.add_argument("model", type=Path, nargs="?")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.dir, args.budget_mib << 20, args.model, args.python)
        return 0
    if args.cmd == "run":
        if not (args.dir / "plan.json").is_file():
            print(f"gpu-check: {args.dir}/plan.json is missing: run 'scripts/gpu-check.sh prepare' on the workstation "
                  "first and carry .gpu-check", file=sys.stderr)
            return 2
        return run(args.dir, args.out, args.runs)
    print(json.dumps(check(args.bundle, args.model)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
