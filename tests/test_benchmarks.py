"""The benchmark suite: a --quick run's structure, and the naive baseline's correctness.

Speed is never asserted here (performance claims live in benchmarks/RESULTS.md): these
tests check that every section is measured with sane numbers and that the naive loop
computes the same FedAvg round as the engine, so the suite's ratios compare like with like.
"""

import os
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT
from fedjax_pan import models
from fedjax_pan.algorithms import client_optimizer, fedavg
from fedjax_pan.engine import ClientData, LocalWork, Simulation, make_executor
from fedjax_pan.models import grouped as grouped_lib

if ROOT not in sys.path:  # benchmarks/ is a top-level folder, not an installed package
    sys.path.insert(0, ROOT)

from benchmarks import fedjax_style  # noqa: E402
from benchmarks import gpu_side_by_side  # noqa: E402
from benchmarks import profile_step  # noqa: E402
from benchmarks import pytorch_style  # noqa: E402
from benchmarks import naive as naive_lib  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks import roofline  # noqa: E402
from benchmarks import run as run_lib  # noqa: E402
from benchmarks.sections import padding  # noqa: E402

# Figures that must be strictly positive wherever they appear.
POSITIVE = {"seconds_per_round", "end_to_end_seconds", "eval_seconds", "examples_per_second",
            "gflops", "fraction_of_ceiling", "best_gflops", "seconds", "peak_rss_mib",
            "seconds_per_client", "padding_efficiency", "expected_padding_efficiency",
            "speedup_vs_naive", "training_speedup_vs_naive", "ratio_to_best",
            "flops_per_example", "warmup_seconds", "total_seconds"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(output dir, results.json, stdout) of one quick suite run (167 s alone on 2 cores,
    2026-11-26; the limit leaves room for the other test worker sharing the cores)."""
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite", "cpu",
                           "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "results.json") as f:
        return out, json.load(f), proc.stdout


def _walk(tree, path=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _walk(v, f"{path}.{k}" if path else k)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, tree


def _engine_configs(results):
    """(name, record) of every engine configuration (not the naive loop)."""
    yield from (("mlp." + k, v) for k, v in results["mlp"]["strategies"].items())
    yield from (("padding." + k, v) for k, v in results["padding"]["configs"].items())
    for key, bench in results["vgg"].items():
        yield from ((f"vgg.{key}.{k}", v) for k, v in bench["strategies"].items())


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_every_section_is_present(quick):
    _, results, _ = quick
    for section in ("meta", "settings", "matmul", "mlp", "padding", "vgg", "scaling",
                    "profile", "algorithms", "defences", "compression", "grouped_conv",
                    "throughput",
                    "compiles", "memory", "targets", "total_seconds"):
        assert section in results, section
    from benchmarks.sections.defences import QUICK
    for rows in results["defences"]["per_round"].values():
        assert set(rows) == set(QUICK) and rows["mean (FedAvg)"]["vs_fedavg"] == 1.0
    from benchmarks.sections import compression
    methods = results["compression"]["methods"]
    assert set(methods) == set(compression.QUICK) and methods["fedavg"]["vs_fedavg"] == 1.0
    # Top-k sends 10% of the values and a bitmap; QSGD 6 bits a value; DP all of them.
    full = methods["fedavg"]["upload_mib"]
    assert 0.1 * full < methods["top_k 10%"]["upload_mib"] < 0.14 * full
    assert methods["qsgd 16 levels"]["upload_mib"] == pytest.approx(6 / 32 * full, rel=1e-3)
    assert methods["dp clipping (z = 1)"]["upload_mib"] == full
    from fedjax_pan.algorithms import ALGORITHMS
    algos = results["algorithms"]["algorithms"]
    drivers = results["algorithms"]["drivers"]
    assert set(algos) | set(drivers["algorithms"]) == set(ALGORITHMS)
    assert algos["fedavg"]["vs_fedavg"] == 1.0
    tuned = results["algorithms"]["fine_tuned"]
    assert tuned["seconds"] > 0 and tuned["vs_fedavg_round"] == pytest.approx(
        tuned["seconds"] / algos["fedavg"]["seconds_per_round"])
    shuffled = results["algorithms"]["shuffled"]
    assert set(shuffled) == {"1", "5"}
    for a in shuffled.values():
        assert a["vs_fedavg"] == pytest.approx(a["seconds_per_round"] /
                                               algos["fedavg"]["seconds_per_round"])
    # FedMA's layers never shrink nor exceed the sampled clients' neurons; it sends its
    # layers up and, down, the model plus each matched layer and the assignments.
    fedma = drivers["algorithms"]["fedma"]
    hidden, m = drivers["hidden"], results["algorithms"]["workload"]["clients_per_round"]
    assert all(h <= w <= m * h for h, w in zip(hidden, fedma["widths"]))
    assert fedma["download_mib"] > drivers["fedavg"]["download_mib"] > 0
    assert fedma["vs_fedavg"] > 0
    # Stateful algorithms keep one parameter-sized state per client; FedAvg keeps none.
    assert algos["fedavg"]["client_state_mib"] == 0.0
    assert algos["scaffold"]["client_state_mib"] == pytest.approx(
        results["algorithms"]["workload"]["num_clients"] *
        results["algorithms"]["workload"]["params"] * 4 / 2**20)
    assert set(results["mlp"]["strategies"]) >= {"loop", "vmap"}
    assert "naive" in results["mlp"] and "naive" in results["padding"]
    assert any("unbucketed" in k for k in results["padding"]["configs"])
    assert any(k.endswith(" bucketed") for k in results["padding"]["configs"])
    assert results["vgg"] and all("auto" in b and "naive" in b for b in results["vgg"].values())
    assert [p["clients_per_round"] for p in results["scaling"]["points"]] == [2, 5, 10]
    # The population grid in increasing K, each point's peak bounding those before it.
    population = results["scaling"]["population"]["points"]
    assert [(p["num_clients"], p["clients_per_round"]) for p in population] == [
        (100, 2), (100, 5), (1000, 2), (1000, 5)]
    peaks = [p["peak_rss_mib"] for p in population]
    assert peaks == sorted(peaks) and all(p["compiles_timed"] == 0 for p in population)
    assert population[2]["client_data_mib"] == pytest.approx(
        10 * population[0]["client_data_mib"])
    assert results["scaling"]["moon"] is None  # not in the quick suite


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_numbers_are_finite_and_key_figures_positive(quick):
    _, results, _ = quick
    checked = 0
    for path, value in _walk(results):
        if isinstance(value, float):
            assert math.isfinite(value), path
        leaf = path.rsplit(".", 1)[-1]
        if leaf in POSITIVE:
            assert isinstance(value, (int, float)) and value > 0, (path, value)
            checked += 1
    assert checked > 50
    assert results["memory"]["peak_rss_mib"] > 0 and results["compiles"]["count"] > 0


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_step_profile_floor_adds_up(quick):
    _, results, _ = quick
    rows = results["profile"]["rows"]
    assert list(rows) == ["ceiling", "shapes", "grad", "update", "stream", "step", "floor"]
    # floor = the matmuls at their shapes + 5 parameter passes at the stream's bandwidth.
    nbytes = 4 * 2_913_290
    want = rows["shapes"]["seconds"] + 5 * nbytes / (rows["stream"]["gb_per_s"] * 1e9)
    assert rows["floor"]["seconds"] == pytest.approx(want, rel=1e-9)
    assert 0 < rows["floor"]["fraction_of_ceiling"] < rows["shapes"]["fraction_of_ceiling"]
    assert rows["ceiling"]["gflops"] == pytest.approx(results["matmul"]["per_section_gflops"]
                                                      ["profile"])


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_padding_efficiency_is_a_fraction(quick):
    _, results, _ = quick
    records = [rec for _, rec in _engine_configs(results)] + [results["padding"]["naive"]]
    for rec in records:
        assert 0 < rec["padding_efficiency"] <= 1
    for rec in results["padding"]["configs"].values():
        assert 0 < rec["expected_padding_efficiency"] <= 1


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_nothing_compiles_after_warm_up(quick):
    _, results, _ = quick
    for name, rec in _engine_configs(results):
        assert rec["compiles_timed"] == 0, name
    assert results["scaling"]["compiles_after_warmup"] == 0


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_suite_records_engine_naive_agreement(quick):
    _, results, _ = quick
    agreements = [results["mlp"]["agreement_max_rel_diff"]] + [
        b["agreement_max_rel_diff"] for b in results["vgg"].values()]
    for agreement in agreements:
        assert set(agreement) >= {"loop", "vmap"}
        assert all(0 <= d <= 1e-4 for d in agreement.values()), agreement


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_targets_and_reports_are_written(quick):
    out, results, stdout = quick
    names = [t["name"] for t in results["targets"]]
    assert len(names) == 19
    for t in results["targets"]:  # the PyTorch target is n/a where torch is not installed
        torch_target = "PyTorch" in t["name"] and not pytorch_style.available()
        assert t["status"] in (("n/a",) if torch_target else ("PASS", "MISS")), t
    markdown = (out / "RESULTS.md").read_text()
    for needle in ["# Benchmark results", "## Targets", "## MLP bench", "## Scaling",
                   "## What stands between the MLP step and the matmul ceiling",
                   "## Algorithms on the MLP bench", "## Execution strategy for grouped models",
                   "## Aggregation rules and stragglers on the MLP bench",
                   "## FedJAX workload (Fashion-MNIST, 20 clients)",
                   "## Start-up on the FedJAX workload",
                   "- commit:", "- machine:", "jax " + results["meta"]["jax"]]:
        assert needle in markdown, needle
    assert all(name in markdown and name in stdout for name in names)
    assert "== Targets" in stdout


def test_cli_rejects_unknown_sections_and_bad_reps():
    with pytest.raises(SystemExit):
        run_lib.parse_args(["--out", "x", "--only", "mlp,nosuch"])
    with pytest.raises(SystemExit):
        run_lib.parse_args(["--out", "x", "--reps", "0"])
    assert run_lib.parse_args(["--out", "x", "--only", "vgg,mlp"]).only == ["vgg", "mlp"]


# ----------------------------------------------------------------------------------------
# Correctness anchor, in process: one FedAvg round, naive loop vs engine, same batches.
# ----------------------------------------------------------------------------------------

SIZES = [21, 30, 8, 17, 26, 12]  # unequal, with partial last batches
BATCH, EPOCHS = 8, 2


def _setup():
    rng = np.random.default_rng(0)
    images = rng.standard_normal((sum(SIZES), 6, 6, 1)).astype(np.float32)
    labels = rng.integers(0, 10, sum(SIZES)).astype(np.int32)
    parts = np.split(rng.permutation(sum(SIZES)), np.cumsum(SIZES)[:-1])
    parts = [np.sort(p) for p in parts]
    model = models.build("mlp", 10, hidden=[32, 16])
    variables = models.init(model, jax.random.PRNGKey(1), (6, 6, 1))
    algorithm = fedavg(model, client_optimizer(0.05, 0.9, 0.0, None))
    return images, labels, parts, model, variables, algorithm


@pytest.mark.parametrize("strategy,block_size", [("loop", None), ("vmap", None),
                                                 ("vmap", 2)])
def test_naive_round_matches_engine_round(strategy, block_size):
    images, labels, parts, model, variables, algorithm = _setup()
    data = ClientData.create(images, labels, parts)
    work = LocalWork(BATCH, EPOCHS)
    executor = make_executor(strategy, algorithm, work, data, variables, 4,
                             block_size=block_size)
    sim = Simulation(algorithm, data, work, executor, 4 / len(SIZES), seed=3)
    state = sim.init(variables)
    cohort = sim.cohort(state, 0)
    engine = algorithm.eval_variables(sim.round(state)[0].server)["params"]

    naive = naive_lib.NaiveFedAvg(model, 0.05, 0.9, BATCH, EPOCHS)
    chosen = [parts[i] for i in cohort.ids]
    same, _ = naive.round(variables["params"], images, labels, chosen,
                          np.random.default_rng(0),
                          naive_lib.engine_orders(cohort.data_keys, data.max_size))
    assert naive_lib.max_rel_diff(engine, same) <= 1e-4
    # Not vacuous: other batches (the naive numpy shuffle) give a visibly different model.
    other, _ = naive.round(variables["params"], images, labels, chosen,
                           np.random.default_rng(0))
    assert naive_lib.max_rel_diff(engine, other) > 1e-3


def _weighted_engine_round(momentum):
    """(images, labels, model, variables, data, cohort, the chosen clients' rows, the
    engine's global params after round 0 of FedAvg weighted by examples)."""
    images, labels, parts, model, variables, _ = _setup()
    algorithm = fedavg(model, client_optimizer(0.05, momentum, 0.0, None))
    data = ClientData.create(images, labels, parts)
    work = LocalWork(BATCH, EPOCHS)
    sim = Simulation(algorithm, data, work, make_executor("auto", algorithm, work, data,
                                                          variables, 4),
                     4 / len(SIZES), aggregation="num_examples", seed=3)
    state = sim.init(variables)
    cohort = sim.cohort(state, 0)
    engine = algorithm.eval_variables(sim.round(state)[0].server)["params"]
    chosen = [parts[i] for i in cohort.ids]
    return images, labels, model, variables, data, cohort, chosen, engine


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fedjax_style_and_weighted_naive_rounds_match_engine_round(momentum):
    images, labels, model, variables, data, cohort, chosen, engine = \
        _weighted_engine_round(momentum)
    order = naive_lib.engine_orders(cohort.data_keys, data.max_size)

    fj = fedjax_style.FedJaxStyleFedAvg(model, 0.05, momentum, BATCH, EPOCHS)
    same, examples = fj.round(variables["params"], images, labels, chosen,
                              np.random.default_rng(0), jax.random.PRNGKey(0), order)
    assert examples == EPOCHS * sum(len(p) for p in chosen)
    assert naive_lib.max_rel_diff(same, engine) <= 1e-4
    naive = naive_lib.NaiveFedAvg(model, 0.05, momentum, BATCH, EPOCHS)
    weighted, _ = naive.round(variables["params"], images, labels, chosen,
                              np.random.default_rng(0), order, weights=data.sizes[cohort.ids])
    assert naive_lib.max_rel_diff(weighted, engine) <= 1e-4
    # Not vacuous: uniform weights, or FedJAX's own numpy shuffle, give another model.
    uniform, _ = naive.round(variables["params"], images, labels, chosen,
                             np.random.default_rng(0), order)
    assert naive_lib.max_rel_diff(uniform, engine) > 1e-3
    other, _ = fj.round(variables["params"], images, labels, chosen,
                        np.random.default_rng(0), jax.random.PRNGKey(0))
    assert naive_lib.max_rel_diff(other, engine) > 1e-3


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_pytorch_style_round_matches_engine_round(momentum):
    pytest.importorskip("torch")  # the optional PyTorch baseline (make bench installs it)
    images, labels, _, variables, data, cohort, chosen, engine = \
        _weighted_engine_round(momentum)
    torch_loop = pytorch_style.PyTorchStyleFedAvg(variables["params"], 0.05, momentum, BATCH,
                                                  EPOCHS)
    _, examples = torch_loop.round(images, labels, chosen, naive_lib.engine_orders(
        cohort.data_keys, data.max_size))
    assert examples == EPOCHS * sum(len(p) for p in chosen)
    assert naive_lib.max_rel_diff(torch_loop.params(), engine) <= 1e-4
    # Not vacuous: PFLlib's own DataLoader shuffle gives another model.
    other = pytorch_style.PyTorchStyleFedAvg(variables["params"], 0.05, momentum, BATCH,
                                             EPOCHS)
    other.round(images, labels, chosen)
    assert naive_lib.max_rel_diff(other.params(), engine) > 1e-3


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_throughput_section(quick):
    """The FedJAX workload: rows, ratios from the throughputs, agreement, start-up."""
    out, results, _ = quick
    r = results["throughput"]
    configs = r["configs"]
    auto = f"{r['auto']} (auto)"
    assert set(configs) >= {auto, "fedjax-style loop", "naive loop"}
    fj, nv = (configs[k]["examples_per_second"] for k in ("fedjax-style loop", "naive loop"))
    for name, c in configs.items():
        assert c["vs_fedjax_style"] == pytest.approx(c["examples_per_second"] / fj)
        assert c["vs_naive"] == pytest.approx(c["examples_per_second"] / nv)
        assert c["reps"] == results["settings"]["throughput"]["reps"]
        if "loop" not in name or name.startswith("loop"):  # engine rows
            assert c["compiles_timed"] == 0, name
    assert configs["fedjax-style loop"]["vs_fedjax_style"] == 1.0
    assert all(0 <= d <= 1e-4 for d in r["agreement_max_rel_diff"].values())
    torch_rows = [k for k in configs if k.startswith("pytorch")]
    assert len(torch_rows) == (1 if pytorch_style.available() else 0)
    for name, c in configs.items():
        if torch_rows:
            pt = configs[torch_rows[0]]["examples_per_second"]
            assert c["vs_pytorch"] == pytest.approx(c["examples_per_second"] / pt)
        else:
            assert "vs_pytorch" not in c
    target = {t["name"]: t for t in results["targets"]}[
        "FedJAX workload: engine (auto) training throughput >= 1.1x the FedJAX-style loop"]
    assert target["value"] == pytest.approx(configs[auto]["vs_fedjax_style"])
    rows = r["startup"]
    assert list(rows) == ["engine (cold cache)", "engine (warm cache)", "fedjax-style"]
    for row in rows.values():
        parts = row["imports_s"] + row["data_s"] + row["build_s"] + row["first_round_s"]
        assert row["to_first_round_s"] == pytest.approx(parts, rel=1e-6)
        assert 0 < row["to_first_round_s"] < row["process_s"] and row["compiles"] > 0
    # The warm run loads what the cold one compiled.
    assert (rows["engine (warm cache)"]["compile_s"] <
            0.5 * rows["engine (cold cache)"]["compile_s"])
    assert "| fedjax-style loop |" in (out / "RESULTS.md").read_text()


def test_use_compilation_cache(tmp_path, monkeypatch):
    from fedjax_pan.engine import compiles
    monkeypatch.setenv(compiles.CACHE_ENV, "/somewhere/else")
    assert compiles.use_compilation_cache(str(tmp_path / "c")) == "/somewhere/else"
    assert not (tmp_path / "c").exists()  # the environment's cache wins, nothing created
    monkeypatch.delenv(compiles.CACHE_ENV)
    assert compiles.use_compilation_cache("") is None
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        assert compiles.use_compilation_cache(str(tmp_path / "c")) == str(tmp_path / "c")
        assert (tmp_path / "c").is_dir()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_unbucketed_executor_keeps_cohort_order():
    images, labels, parts, _, variables, algorithm = _setup()
    data = ClientData.create(images, labels, parts)
    bucketed = make_executor("vmap", algorithm, LocalWork(BATCH, EPOCHS), data, variables, 5,
                             block_size=2)
    unbucketed = padding._unbucketed(bucketed)
    steps = np.array([2, 9, 4, 9, 3])
    assert [g.tolist() for g in unbucketed.blocks(steps)] == [[0, 1], [2, 3], [4, -1]]
    assert [g.tolist() for g in bucketed.blocks(steps)] == [[1, 3], [2, 4], [0, -1]]
    # Sorting pairs the long clients: fewer computed steps than the cohort order.
    sizes = data.sizes[:5]
    assert bucketed.computed_examples(sizes, steps) < unbucketed.computed_examples(sizes, steps)


@pytest.mark.slow  # the quick suite run (shared fixture): about 2 minutes
def test_grouped_conv_section(quick):
    """The grouped_conv section of the quick run: FLOPs, auto's pick, tables and targets."""
    out, results, _ = quick
    r = results["grouped_conv"]
    impls = {"feature_group_count", "split", "block_diagonal"}
    (layer,) = r["layers"]
    assert set(layer["impls"]) == impls and layer["dense"]["gflops"] > 0
    # FLOPs of the grouped conv itself: the dense reference does G times more work.
    b, n, c, g, k = (layer[key] for key in ("batch", "size", "channels", "groups", "kernel"))
    assert layer["flops"] == 6 * b * n * n * k * k * c * c // g
    assert layer["auto"]["picks"] == grouped_lib.pick_conv_impl(g, c)
    for rec in [layer, r["vgg_step"]]:
        auto = rec["auto"]
        assert {auto["picks"], auto["best"], auto["slowest"]} <= impls
        assert auto["ratio_to_best"] >= 1.0 and auto["slowest_over_auto"] > 0
        assert all(v["seconds"] > 0 and v["reps"] >= 1 for v in rec["impls"].values())
    picks = {}
    for name, rnd in r["rounds"].items():
        assert set(rnd["strategies"]) >= {"loop", "vmap"}
        assert all(v["compiles_timed"] == 0 for v in rnd["strategies"].values())
        picks[name] = rnd["auto"]["picks"]
    # On CPU, auto runs grouped convnets client by client and dense models vmapped.
    assert sorted(picks.values()) == ["loop", "vmap"], picks
    status = {t["name"]: t["status"] for t in results["targets"]}
    assert [v for k, v in status.items() if "grouped" in k] not in ([], ["n/a", "n/a"])
    with open(os.path.join(out, "RESULTS.md")) as f:
        markdown = f.read()
    for needle in ["## Grouped conv layers, forward + backward (cpu)",
                   "## Grouped VGG9 local step per conv implementation",
                   "## Execution strategy for grouped models", "split (auto)",
                   "dense reference"]:
        assert needle in markdown, needle


# ----------------------------------------------------------------------------------------
# The roofline: XLA's cost of a round, the machine's roof, the fractions.
# ----------------------------------------------------------------------------------------

def test_xla_cost_and_roof_arithmetic():
    a, b = np.ones((64, 128), np.float32), np.ones((128, 32), np.float32)
    cost = roofline.program_cost(lambda a, b: a @ b, a, b)
    assert cost.flops == 2 * 64 * 128 * 32
    assert cost.bytes >= 4 * (64 * 128 + 128 * 32 + 64 * 32)

    class OldJax:  # JAX 0.4.3x: one dict per program, in a list
        def cost_analysis(self):
            return [{"flops": 6.0, "bytes accessed": 2.0}]
    assert roofline.xla_cost(OldJax()) == roofline.Cost(6.0, 2.0)
    roof = roofline.Roof(peak_gflops=10.0, bandwidth_gbs=2.0, peak_gflops_bf16=40.0)
    compute, memory = roofline.Cost(1e9, 1e8), roofline.Cost(1e8, 1e9)
    assert roof.seconds(compute) == pytest.approx(0.1) and roof.bound(compute) == "compute"
    assert roof.seconds(memory) == pytest.approx(0.5) and roof.bound(memory) == "memory"
    assert roof.seconds(compute, "bfloat16") == pytest.approx(0.05)
    rec = roofline.row_record([compute, memory], [0.4, 0.8], roof)
    assert rec["fraction_of_roofline"] == pytest.approx(0.6 / 1.2)
    assert rec["xla_flops_per_round"] == pytest.approx(5.5e8)
    assert roofline.row_record([compute, None], [0.4, 0.8], roof) == {
        "fraction_of_roofline": None}


def test_loop_cost_counts_batches_clients_and_rounds():
    # A step whose cost is linear in its rows: the short batch is interpolated exactly.
    loop = roofline.LoopCost(lambda r: roofline.Cost(10.0 * r + 5, 2.0 * r),
                             batch_size=8, per_client=roofline.Cost(1.0, 1.0),
                             per_round=roofline.Cost(100.0, 0.0))
    assert loop.step(3) == roofline.Cost(35.0, 6.0)
    # Clients of 20 (8 + 8 + 4) and 8 examples, 2 epochs.
    got = loop.round([20, 8], epochs=2)
    steps = 2 * ((85 + 85 + 45) + 85)
    assert got.flops == pytest.approx(steps + 2 * 1.0 + 100.0)
    assert got.bytes == pytest.approx(2 * ((16 + 16 + 8) + 16) + 2 * 1.0)


def test_measure_bandwidth_reports_copy_and_triads():
    bw = roofline.measure_bandwidth(mib=2, reps=2)
    assert min(bw["copy_gbs"], bw["triad_gbs"], bw["numpy_triad_gbs"]) > 0
    assert bw["bandwidth_gbs"] == max(bw["triad_gbs"], bw["numpy_triad_gbs"])


def _tiny_round(strategy, block_size, images, labels, parts):
    model = models.build("mlp", 10, hidden=[32, 16])
    variables = models.init(model, jax.random.PRNGKey(1), (6, 6, 1))
    algorithm = fedavg(model, client_optimizer(0.05, 0.9, 0.0, None))
    data = ClientData.create(images, labels, parts)
    work = LocalWork(BATCH, EPOCHS)
    sim = Simulation(algorithm, data, work, make_executor(
        strategy, algorithm, work, data, variables, 4, block_size=block_size),
        4 / len(parts), seed=3)
    return sim, sim.init(variables)


@pytest.mark.parametrize("strategy,block_size", [("loop", None), ("vmap", 2)])
def test_engine_cost_of_a_round(strategy, block_size):
    images, labels, parts, *_ = _setup()
    sim, state = _tiny_round(strategy, block_size, images, labels, parts)
    model = roofline.EngineCost(sim)
    cost = model.round(state)
    cohort = sim.cohort(state, 0)
    _, stats = sim.round(state)
    rows = model.rows(cohort)
    # The rows costed are the rows the round computed, padding included.
    assert rows == stats["computed_examples"]
    # Independent count: multiply-adds of 36-32-16-10 per row, forward and weight grads
    # (2 + 2 FLOPs each) and input grads past the first layer (2 each); the rest
    # (activations, loss, momentum SGD over 1,882 parameters a step) is small.
    steps = int(np.sum(cohort.steps)) if block_size is None else rows // (BATCH * 2)
    per_row = 4 * (36 * 32 + 32 * 16 + 16 * 10) + 2 * (32 * 16 + 16 * 10)
    assert per_row * rows <= cost.flops <= 1.5 * per_row * rows + 40 * 1882 * steps
    assert cost.bytes > 4 * 1882 * steps  # at least one pass over the weights a step


def test_a_round_with_client_states_is_costed():
    # Scaffold keeps a control variate per client: its cohort's states are a stack, and
    # each client's functions are costed on one slice of it (a model's worth more bytes
    # read and written a client than FedAvg's).
    from fedjax_pan.algorithms.fedavg_family.scaffold import scaffold
    images, labels, parts, model, variables, plain = _setup()
    data, work = ClientData.create(images, labels, parts), LocalWork(BATCH, EPOCHS)
    costs = []
    for algorithm in (plain, scaffold(model, client_optimizer(0.05, 0.0, 0.0, None), 0.05)):
        sim = Simulation(algorithm, data, work, make_executor(
            "loop", algorithm, work, data, variables, 4), 4 / len(parts), seed=3)
        costs.append(roofline.EngineCost(sim).round(sim.init(variables)))
    assert costs[1] is not None and costs[1].flops >= costs[0].flops > 0
    assert costs[1].bytes > costs[0].bytes + 4 * 4 * 1882  # four clients' states


def test_engine_step_cost_reads_the_batch_not_the_dataset():
    # XLA costs a gather as reading its whole operand; the model lowers the step on a
    # batch-sized dataset, so the same clients in a 20x larger training set cost the same.
    images, labels, parts, *_ = _setup()
    small_sim, small = _tiny_round("loop", None, images, labels, parts)
    big_sim, big = _tiny_round("loop", None, np.concatenate([images] * 20),
                               np.concatenate([labels] * 20), parts)
    assert roofline.EngineCost(big_sim).round(big) == roofline.EngineCost(
        small_sim).round(small)


def test_mlp_target_is_judged_on_the_roofline():
    rec = {"fraction_of_roofline": 0.9, "fraction_of_ceiling": 0.2,
           "speedup_vs_naive": 1.5, "training_speedup_vs_naive": 1.5}
    results = {"mlp": {"strategies": {"vmap": rec}, "auto": {"picks": "vmap",
                                                             "ratio_to_best": 1.0}}}
    target = report.evaluate_targets(results)[0]
    assert "roofline" in target["name"] and target["value"] == 0.9
    assert target["status"] == "PASS"
    rec["fraction_of_roofline"] = 0.5
    assert report.evaluate_targets(results)[0]["status"] == "MISS"


def test_trace_summary_of_an_engine_round(tmp_path):
    images, labels, parts, *_ = _setup()
    sim, state = _tiny_round("loop", None, images, labels, parts)
    state, _ = sim.round(state)  # compiled before the trace
    with jax.profiler.trace(str(tmp_path)):
        state, _ = sim.round(state)
        jax.block_until_ready(state.server)
    summary = profile_step.trace_summary(str(tmp_path))
    assert 0 < summary["xla_busy_s"] <= summary["xla_thread_s"] + 1e-9
    names = [f["name"] for f in summary["engine_functions"]]
    assert any(n.startswith("simulation.py") and n.endswith(" round") for n in names), names
    assert summary["xla_ops"] and all(o["seconds"] >= 0 for o in summary["xla_ops"])


def test_gpu_targets_are_judged_on_their_rows():
    f32, bf16, fj = (f"{gpu_side_by_side.ENGINE} float32", f"{gpu_side_by_side.ENGINE} "
                     "bfloat16", gpu_side_by_side.FEDJAX)
    results = {"points": [
        {"clients_per_round": 100, "rows": {f32: {"examples_per_second": 900.0,
                                                  "vs_fedjax": 3.0}, fj: {}}},
        {"clients_per_round": 1000, "rows": {f32: {"examples_per_second": 1000.0,
                                                   "fraction_of_roofline": 0.55},
                                             bf16: {"examples_per_second": 1700.0}}}]}
    got = {t["name"].split(" >= ")[1][:12]: (t["status"], t["value"])
           for t in gpu_side_by_side.targets(results)}
    assert got == {"60% of its r": ("MISS", 0.55), "1.6x float32": ("PASS", 1.7),
                   "3x FedJAX's ": ("PASS", 3.0)}
    results["points"] = results["points"][:1]  # no 1,000 clients a round: not measured
    assert [t["status"] for t in gpu_side_by_side.targets(results)] == ["n/a", "n/a", "PASS"]


def test_gpu_side_by_side_quick(tmp_path, capsys):
    """The GPU script's dry run on this CPU: the engine rows, the skipped ones with their
    note, the files for RESULTS_gpu.md."""
    from fedjax_pan.config.defaults import default_config
    assert gpu_side_by_side.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "side_by_side.json").read_text())
    (point,) = results["points"]
    rows = point["rows"]
    has_precision = "precision" in default_config().execution
    assert ("fedjax_pan bfloat16" in rows) == has_precision
    assert "fedjax_pan float32" in rows
    for name, r in rows.items():
        assert r["examples_per_second"] > 0 and r["fraction_of_roofline"] > 0, name
        assert r["dtype"] == ("bfloat16" if "bfloat16" in name else "float32")
    try:
        gpu_side_by_side.import_fedjax()
        fedjax_here = True
    except ImportError:
        fedjax_here = False
    assert (gpu_side_by_side.FEDJAX in rows) == fedjax_here
    if not fedjax_here:
        assert any("skipped, fedjax does not import" in n for n in results["notes"])
    if not pytorch_style.available():
        assert any("torch is not installed" in n for n in results["notes"])
    for r in rows.values():
        if gpu_side_by_side.FEDJAX in rows:
            assert r["vs_fedjax"] == pytest.approx(
                r["examples_per_second"] / rows[gpu_side_by_side.FEDJAX]["examples_per_second"])
        else:
            assert "vs_fedjax" not in r
    markdown = (tmp_path / "side_by_side.md").read_text()
    assert "| 4 | fedjax_pan float32 |" in markdown and markdown in capsys.readouterr().out
