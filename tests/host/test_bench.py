"""`tandoor bench` and `tandoor profile` / `compile --profile` end to end, as a user runs them.
Real models, real runs; the assertions are about structure and decisions, never about speed."""

from __future__ import annotations

import hashlib
import json

import pytest

from support.cli import manifest_of, run_cli
from tandoor_zoo import models as zoo

REQUIRED = {"onnxruntime_ms", "tvm_ms", "hybrid_ms", "ratio_hybrid_vs_ort", "ratio_tvm_vs_ort", "memory"}


@pytest.fixture(scope="module")
def small_model():
    return zoo.with_unsupported_middle()      # two delegated subgraphs with TVM's Erf between


@pytest.fixture(scope="module")
def bench_json(small_model, tmp_path_factory):
    png = tmp_path_factory.mktemp("bench") / "bench.png"
    # --policy all: both subgraphs delegated whatever this (loaded) machine measures, so the
    # structure below does not hang on a timing; the cost decision has its own tests
    res = run_cli("tandoor", "bench", str(small_model), "--runs", "10", "--blocks", "2", "--json", "--plot", str(png),
                  "--policy", "all", check=True)
    return json.loads(res.stdout), png


def test_bench_json_keys_and_sane_values(bench_json):
    r, _ = bench_json
    assert REQUIRED <= set(r)
    ort = r["onnxruntime_ms"]
    assert ort > 0 and r["tvm_ms"] > 0
    assert set(r["hybrid_ms"]) >= {"onnxruntime", "tvm"}
    assert set(r["ratio_hybrid_vs_ort"]) == set(r["hybrid_ms"])
    for e, ms in r["hybrid_ms"].items():
        assert ms > 0
        assert r["ratio_hybrid_vs_ort"][e] == pytest.approx(ms / ort, rel=2e-3, abs=2e-3)
    assert r["ratio_tvm_vs_ort"] == pytest.approx(r["tvm_ms"] / ort, rel=2e-3, abs=2e-3)
    d = r["details"]
    assert d["runs"] == 10 and d["blocks"] == 2 and all(s["n"] == 20 for s in d["spread"].values())
    assert d["delegated_subgraphs"] == 2


def test_bench_latency_has_percentiles_and_the_spread_over_blocks(bench_json):
    """Every path: p50 <= p95 <= p99 within its fastest and slowest run, and per block its median,
    the spread being the worst block median over the best."""
    r, _ = bench_json
    lat, spread = r["latency"], r["details"]["spread"]
    assert set(lat) == set(spread) >= {"onnxruntime", "onnxruntime-nospin", "tvm", "choice", "all-delegated",
                                       *(f"hybrid:{e}" for e in r["hybrid_ms"])}
    for name, q in lat.items():
        s = spread[name]
        assert s["min_ms"] - 1e-3 <= q["p50_ms"] <= q["p95_ms"] <= q["p99_ms"] <= s["max_ms"] + 1e-3, (name, q, s)
        assert q["p99_over_p50"] == pytest.approx(q["p99_ms"] / q["p50_ms"], rel=2e-3, abs=2e-3)
        meds = q["block_medians_ms"]
        assert q["blocks"] == len(meds) == 2 and all(s["min_ms"] - 1e-3 <= m <= s["max_ms"] + 1e-3 for m in meds)
        assert q["block_spread"] == pytest.approx(max(meds) / min(meds), rel=2e-3, abs=2e-3) and q["block_spread"] >= 1


def test_bench_armnn_cpuref_is_skipped_with_the_reason(bench_json):
    from tandoor_agent.run.executors import armnn

    r, _ = bench_json
    ok, _ = armnn.available()
    if ok and not set(armnn.backends()) & {"CpuAcc", "GpuAcc"}:
        assert "armnn" not in r["hybrid_ms"]
        assert "reference implementation" in r["details"]["skipped"]["armnn"]
    elif ok:
        assert "armnn" in r["hybrid_ms"]


def test_bench_breakdown_adds_up(bench_json):
    r, _ = bench_json
    b = r["breakdown"]
    assert b["onnxruntime"]["total_ms"] == pytest.approx(r["onnxruntime_ms"], abs=1e-3)
    assert b["tvm"]["delegated_ms"] == 0 and b["tvm"]["total_ms"] == pytest.approx(r["tvm_ms"], abs=1e-3)
    for e, h in b["hybrid"].items():
        assert h["total_ms"] == pytest.approx(r["hybrid_ms"][e], abs=1e-3)
        parts = h["pre_ms"] + h["delegated_ms"] + h["tvm_ms"] + h["bridge_ms"]
        assert h["delegated_ms"] > 0 and h["bridge_ms"] >= 0 and h["pre_ms"] >= 0
        if h["tvm_ms"] > 0:        # TVM is the remainder, clamped at 0 when medians disagree
            assert parts == pytest.approx(h["total_ms"], abs=2e-3)
        assert [s["executor"] for s in h["subgraphs"]] == [e, e]


def test_bench_memory_per_path(bench_json):
    r, _ = bench_json
    mem = r["memory"]
    assert {"onnxruntime", "tvm", "hybrid"} <= set(mem)
    assert set(mem["hybrid"]) == set(r["hybrid_ms"])
    for m in [mem["onnxruntime"], mem["tvm"], *mem["hybrid"].values()]:
        assert m["rss_growth_mb"] >= 0
    t = mem["tvm"]
    # lifetimes that do not overlap share storage: the plan never needs more than one buffer
    # per intermediate, at least the largest tensor, and saves something on a 10-layer CNN
    assert t["largest_tensor_mb"] <= t["planned_activation_mb"] < t["unplanned_activation_mb"]
    assert 0 < t["plan_saves_pct"] < 100 and t["intermediates"] >= 8
    # the hybrid's TVM side keeps only the boundary tensors: less than TVM-only needs
    assert mem["hybrid"]["onnxruntime"]["unplanned_activation_mb"] < t["unplanned_activation_mb"]


def test_bench_plot_is_a_png(bench_json):
    _, png = bench_json
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_bad_model_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "nope.onnx"
    res = run_cli("tandoor", "bench", str(bad), "--json")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "no such file" in res.stderr


# --- profiles ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def profiled(small_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("profile")
    bundle = d / "all.hmod"
    run_cli("tandoor", "compile", str(small_model), "-o", str(bundle), "--policy", "all", "-q", check=True)
    prof = d / "profile.json"
    res = run_cli("tandoor", "profile", str(bundle), "-o", str(prof), "--runs", "5", "--warmup", "2",
                  "--executor", "onnxruntime", "--executor", "tvm", "--json", check=True)
    return bundle, prof, json.loads(res.stdout)


def test_profile_is_keyed_and_measures_every_subgraph(profiled):
    bundle, prof, printed = profiled
    p = json.loads(prof.read_text())
    assert p == printed
    k = p["key"]
    import zipfile

    with zipfile.ZipFile(bundle) as z:
        assert k["bundle_sha256"] == hashlib.sha256(z.read("manifest.json")).hexdigest()
    man = manifest_of(bundle)
    assert k["source_sha256"] == man["model"]["source_sha256"]
    assert k["inputs"] == [{"name": i["name"], "shape": i["shape"], "dtype": i["dtype"]} for i in man["inputs"]]
    assert k["board"] and k["arch"] == "x86_64"
    assert set(k["libraries"]) >= {"tvm", "onnxruntime", "armnn"} and k["libraries"]["tvm"]
    symbols = [q["symbol"] for q in man["partitions"] if q["delegate"]]
    assert sorted(p["subgraphs"]) == sorted(symbols) and len(symbols) == 2
    for sym, s in p["subgraphs"].items():
        assert s["tvm_us"] > 0 and s["exec_us"]["onnxruntime"] > 0 and s["bridge_us"]["onnxruntime"] >= 0
        assert s["ops"] == next(q["ops"] for q in man["partitions"] if q["symbol"] == sym)
    assert p["model"]["onnxruntime"]["total_us"] > 0 and p["model"]["tvm_side_us"] >= 0
    # a whole-model time is its executor's: at least one subgraph really ran on it
    timed = {e: v for e, v in p["model"].items() if isinstance(v, dict) and "total_us" in v}
    assert timed and all(e in v["executors"].values() for e, v in timed.items()), timed


def test_profile_of_an_executor_that_runs_no_order_is_an_error_not_a_time(profiled):
    """The bundle has no NPU orders: asked for the whole model on rknn, every order falls back to
    another executor, so there is no rknn time to report (it once printed Arm NN CpuRef's as rknn's)
    and none goes into the TVM side's median; the CLI says so in one line."""
    from tandoor_agent.run import profile as prof

    bundle, _, _ = profiled
    p = prof.measure(bundle, runs=1, warmup=0, executors=("rknn",))
    rk = p["model"]["rknn"]
    assert set(rk) == {"error"} and rk["error"].startswith("rknn runs none of this bundle's orders (they fell back to ")
    fell_to = rk["error"].removesuffix(")").rsplit("fell back to ", 1)[1].split(", ")
    assert fell_to and set(fell_to) <= set(prof.EXECUTORS) - {"rknn"}, rk
    assert p["model"]["tvm_side_us"] is None
    assert all("rknn" in s["unavailable"] and "rknn" not in s["exec_us"] for s in p["subgraphs"].values())
    res = run_cli("tandoor-agent", "profile", str(bundle), "--runs", "1", "--warmup", "0", "--executor", "rknn",
                  check=True)
    [line] = [x for x in res.stdout.splitlines() if x.startswith("whole model with rknn")]
    assert line == f"whole model with rknn: not measured: {rk['error']}", res.stdout
    assert "Traceback" not in res.stderr


def test_agent_profile_on_a_board_without_the_compiler_feeds_compile(profiled, small_model, tmp_path):
    """`tandoor-agent profile` (what a board has) measures the same thing, keyed the same, and
    compile takes its file."""
    bundle, _, host = profiled
    prof = tmp_path / "board.json"
    res = run_cli("tandoor-agent", "profile", str(bundle), "-o", str(prof), "--runs", "3", "--warmup", "1",
                  "--executor", "onnxruntime", "--executor", "tvm", check=True)
    p = json.loads(prof.read_text())
    assert p["key"] == host["key"]
    assert sorted(p["subgraphs"]) == sorted(host["subgraphs"])
    for sym, s in p["subgraphs"].items():
        assert s["tvm_us"] > 0 and s["exec_us"]["onnxruntime"] > 0
        assert sym in res.stdout  # one table row per subgraph
    assert f"profile written to {prof}" in res.stdout
    out = tmp_path / "from-board.hmod"
    run_cli("tandoor", "compile", str(small_model), "-o", str(out), "--profile", str(prof), "-q", check=True)
    assert manifest_of(out)["profile"]["sha256"] == hashlib.sha256(prof.read_bytes()).hexdigest()
    bad = run_cli("tandoor-agent", "profile", str(bundle), "-o", str(tmp_path))
    assert bad.returncode == 2 and "is a directory" in bad.stderr and not list(tmp_path.glob("*.tmp"))


def test_compile_with_profile_uses_measured_numbers_and_records_executors(profiled, small_model, tmp_path):
    _, prof, p = profiled
    out = tmp_path / "prof.hmod"
    run_cli("tandoor", "compile", str(small_model), "-o", str(out), "--profile", str(prof), "-q", check=True)
    man = manifest_of(out)
    assert man["profile"]["sha256"] == hashlib.sha256(prof.read_bytes()).hexdigest()
    assert man["profile"]["board"] == p["key"]["board"]
    for part in man["partitions"]:
        est = part["est"]
        assert est["source"] == "profile"
        meas = p["subgraphs"][part["symbol"]]
        assert est["tvm_us"] == pytest.approx(meas["tvm_us"], abs=0.01)
        assert est["exec_us"]["onnxruntime"] == pytest.approx(meas["exec_us"]["onnxruntime"], abs=0.01)
        assert "armnn" not in est["exec_us"]          # not measured: not a candidate
        assert part["reason"].startswith("cost (profile):")
        if part["delegate"]:
            assert part["executor"] == est["executor"] == "onnxruntime"
        else:
            assert "executor" not in part


def _mutated(prof, tmp_path, name, change):
    p = json.loads(prof.read_text())
    change(p)
    path = tmp_path / name
    path.write_text(json.dumps(p))
    return path


@pytest.mark.parametrize("name,change,expect", [
    ("shapes.json", lambda p: p["key"]["inputs"][0].__setitem__("shape", [1, 3, 32, 32]), "input shapes differ"),
    ("tvm.json", lambda p: p["key"]["libraries"].__setitem__("tvm", "0.19.0"), "library tvm differs"),
    ("ort.json", lambda p: p["key"]["libraries"].__setitem__("onnxruntime", "1.0.0"), "library onnxruntime differs"),
    ("model.json", lambda p: p["key"].__setitem__("source_sha256", "0" * 64), "model differs"),
    ("ops.json", lambda p: next(iter(p["subgraphs"].values()))["ops"].append("nn.softmax"), "holds"),
])
def test_compile_refuses_a_profile_whose_key_does_not_match(profiled, small_model, tmp_path, name, change, expect):
    _, prof, _ = profiled
    bad = _mutated(prof, tmp_path, name, change)
    out = tmp_path / "x.hmod"
    res = run_cli("tandoor", "compile", str(small_model), "-o", str(out), "--profile", str(bad), "-q")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("tandoor: error: profile ") and expect in line, line
    assert not out.exists()


def test_compile_refuses_a_profile_of_another_model(profiled, tmp_path):
    _, prof, _ = profiled
    res = run_cli("tandoor", "compile", str(zoo.vgg_small()), "-o", str(tmp_path / "v.hmod"), "--profile", str(prof), "-q")
    assert res.returncode == 2 and "model differs" in res.stderr and "\n" not in res.stderr.strip()
