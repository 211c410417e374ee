"""The paper-figure scripts in experiments/: each `smoke` preset runs and its outputs are
consistent (the library functions they use are tested in their own modules)."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, signal_on_call

if ROOT not in sys.path:  # `experiments` is a folder of the checkout, not an installed package
    sys.path.insert(0, ROOT)

from experiments import (alignment, common, fusion, r_kept, sharing_depth,  # noqa: E402
                         shuffle_accuracy, shuffle_error, weight_divergence)

SCRIPTS = {"r_kept": r_kept, "shuffle_error": shuffle_error,
           "shuffle_accuracy": shuffle_accuracy, "weight_divergence": weight_divergence,
           "alignment": alignment, "sharing_depth": sharing_depth, "fusion": fusion}


def _finite(values):
    values = np.asarray(list(values), np.float64)
    return values.size > 0 and bool(np.all(np.isfinite(values)))


def _json(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each script's smoke preset, run once in-process: {name: output folder}."""
    out = {}
    for name, module in SCRIPTS.items():
        folder = str(tmp_path_factory.mktemp(name))
        assert module.main(["--out", folder, "--preset", "smoke", "--no-progress"]) == 0
        info = _json(os.path.join(folder, "run_info.json"))
        assert info["script"] == name and info["preset"] == "smoke" and info["seconds"] > 0
        out[name] = folder
    return out


def test_every_script_has_the_three_presets():
    for module in SCRIPTS.values():
        assert set(module.PRESETS) >= set(common.PRESETS)
        assert "Fig." in module.__doc__


def test_fl_presets_are_valid_configs():
    from fedjax_pan.run import experiment
    for module in (weight_divergence, alignment):
        for name, settings in module.PRESETS.items():
            for pan in (common.PANS_OFF, settings.pan_on):
                experiment.validate(common.fl_config(settings.setup, pan, seed=0))


@pytest.mark.slow  # every script's smoke preset run (shared fixture)
def test_r_kept(runs):
    d = runs["r_kept"]
    rows = common.read_csv(os.path.join(d, "r_kept_vs_psf.csv"))
    assert _finite(float(r["r_kept_mean"]) for r in rows)
    for r in rows:
        if float(r["p_sf"]) == 0.0:
            assert float(r["r_kept_mean"]) == 1.0
        if float(r["p_sf"]) == 1.0 and r["variant"] == "Alg. 1":
            assert float(r["r_kept_mean"]) == 0.0  # every neuron swapped away
    fl = common.read_csv(os.path.join(d, "r_kept_vs_nsf.csv"))
    assert _finite(float(r["r_kept_mean"]) for r in fl)
    assert all(float(r["r_kept_mean"]) == 1.0 for r in fl if float(r["n_sf"]) == 0.0)
    for name in ("fig2_r_kept.png", "fig5_r_kept_nsf.png", "r_kept.json"):
        assert os.path.getsize(os.path.join(d, name)) > 0


@pytest.mark.slow  # every script's smoke preset run (shared fixture)
def test_shuffle_error_vanishes_without_pans(runs):
    d = runs["shuffle_error"]
    summary = _json(os.path.join(d, "shuffle_error.json"))["models"]
    assert set(summary) == {"mlp", "vgg13", "resnet20"}
    rows = common.read_csv(os.path.join(d, "shuffle_error.csv"))
    assert _finite(float(r["shuffle_error"]) for r in rows)
    for name, s in summary.items():
        assert s["relative_error_at_A0"] < 1e-5, name
        assert os.path.getsize(os.path.join(d, f"shuffle_error_{name}.png")) > 0
    for r in rows:
        rel = float(r["relative_error"])
        if float(r["amplitude"]) == 0.0 or float(r["period"]) == 0.0:
            assert rel < 1e-5, r
        else:  # PANs on: shuffling changes the output
            assert rel > 1e-3, r


@pytest.mark.slow  # every script's smoke preset run (shared fixture)
def test_shuffle_accuracy(runs):
    d = runs["shuffle_accuracy"]
    rows = common.read_csv(os.path.join(d, "shuffle_accuracy.csv"))
    acc = [float(r["accuracy"]) for r in rows]
    assert _finite(acc) and min(acc) >= 0.0 and max(acc) <= 1.0
    assert {r["variant"] for r in rows} == {"PANs off", "PAN+ T=1 A=0.05", "PANx T=1 A=0.1"}
    for r in rows:
        if float(r["p_sf"]) == 0.0:  # the identity permutation
            assert float(r["accuracy"]) == float(r["unshuffled_accuracy"])
        if r["variant"] == "PANs off":  # permutation invariant (up to rounding)
            assert abs(float(r["accuracy"]) - float(r["unshuffled_accuracy"])) <= 0.01
    assert os.path.getsize(os.path.join(d, "fig4_shuffle_accuracy.png")) > 0


@pytest.mark.slow  # every script's smoke preset run (shared fixture)
def test_weight_divergence(runs):
    d = runs["weight_divergence"]
    results = _json(os.path.join(d, "weight_divergence.json"))["results"]
    assert results
    for res in results:
        for side in ("off", "on"):
            div = res["divergence"][side]
            assert set(div) == {"fc1", "fc2", "fc3", "head"}
            assert _finite(div.values()) and min(div.values()) > 0
            assert math.isclose(res["total"][side], sum(div.values()), rel_tol=1e-9)
        png = f"fig6_divergence_E{res['epochs']:g}_alpha{res['alpha']:g}.png"
        assert os.path.getsize(os.path.join(d, png)) > 0
    rows = common.read_csv(os.path.join(d, "weight_divergence.csv"))
    assert len(rows) == 8 * len(results)
    # Two seeds, each paired with itself: the summary by hand from the per-seed results.
    assert sorted(r["seed"] for r in results) == [0, 1]
    summary = _json(os.path.join(d, "weight_divergence.json"))["summary"]
    for row in summary:
        if row["layer"] in ("total", "test_accuracy"):
            continue
        off = [r["divergence"]["off"][row["layer"]] for r in results]
        on = [r["divergence"]["on"][row["layer"]] for r in results]
        assert row["seeds"] == 2 and row["off_mean"] == pytest.approx(np.mean(off))
        assert row["diff_mean"] == pytest.approx(np.mean(np.subtract(on, off)))
        assert row["diff_std"] == pytest.approx(np.std(np.subtract(on, off)))
        assert row["ratio_mean"] == pytest.approx(np.mean(np.divide(on, off)))
    assert {r["layer"] for r in summary} == {"fc1", "fc2", "fc3", "head", "total",
                                            "test_accuracy"}


@pytest.mark.slow  # every script's smoke preset run (shared fixture)
def test_alignment(runs):
    d = runs["alignment"]
    results = _json(os.path.join(d, "alignment.json"))["results"]
    for side in ("off", "on"):
        res = results[side]
        # Neurons represented pre-ReLU (none silent); the head's preferences (FC4, Fig. 22).
        assert set(res["diagonal_ratio"]) == {"fc2", "fc3"} and res["dead_neurons"]["fc3"] == 0
        assert set(res["class_agreement"]) == {"fc2", "fc3", "head"}
        assert os.path.getsize(os.path.join(d, f"fig8_preferences_head_{side}.png")) > 0
        values = [*res["diagonal_ratio"].values(), *res["class_agreement"].values()]
        assert _finite(values) and all(0.0 <= v <= 1.0 for v in values)
        for layer in ("fc2", "fc3"):
            for fig in ("fig7_assignment", "fig8_preferences"):
                assert os.path.getsize(os.path.join(d, f"{fig}_{layer}_{side}.png")) > 0
    out = _json(os.path.join(d, "alignment.json"))
    assert out["representation"] == "post-PAN pre-ReLU"
    # The summary pairs the two seeds' analyses (off and on of the same seed).
    assert len(out["per_seed"]) == 2
    for row in out["summary"]:
        if row["analysis"] == "test_accuracy":
            continue
        off, on = ([p[side][row["analysis"]][row["layer"]] for p in out["per_seed"]]
                   for side in ("off", "on"))
        assert row["on_mean"] == pytest.approx(np.mean(on))
        assert row["diff_mean"] == pytest.approx(np.mean(np.subtract(on, off)))


@pytest.mark.slow  # every script's smoke preset run (shared fixture)
def test_sharing_depth(runs):
    out = _json(os.path.join(runs["sharing_depth"], "sharing_depth.json"))
    tv = out["total_variance"]
    assert list(tv) == ["fc1", "fc2", "fc3"] and _finite(tv.values())
    shared = out["shared_layers"]
    # The shared layers are those before the first TV above the threshold.
    assert all(v <= out["threshold"] for v in list(tv.values())[:shared])
    assert shared == len(tv) or list(tv.values())[shared] > out["threshold"]
    assert out["grouped_depth"] == max(2, 4 - shared)  # 3 hidden layers + the head
    rows = common.read_csv(os.path.join(runs["sharing_depth"], "sharing_depth.csv"))
    assert [r["layer"] for r in rows] == list(tv)
    assert os.path.getsize(os.path.join(runs["sharing_depth"], "fig10_sharing_depth.png")) > 5000


@pytest.mark.slow  # every script's smoke preset run (shared fixture)
def test_fusion(runs):
    s = fusion.PRESETS["smoke"]
    rows = common.read_csv(os.path.join(runs["fusion"], "fusion.csv"))
    assert len(rows) == len(s.networks) * len(fusion.METHODS) * len(s.seeds) * len(s.mus)
    acc = {(r["method"], float(r["mu"])): float(r["accuracy"]) for r in rows}
    assert _finite(acc.values())
    # mu = 0 is model A whatever B' is; with PANs off the aligned B is B's function, so mu = 1
    # agrees too; in between the curves differ (B' has other weights).
    for a, b in (("Avg", "OT+Avg"), ("PANs+Avg", "PANs+OT+Avg")):
        assert acc[(a, 0.0)] == acc[(b, 0.0)]
    assert acc[("Avg", 1.0)] == acc[("OT+Avg", 1.0)]
    assert acc[("Avg", 1.0)] > 0.5 and acc[("Avg", 0.0)] > 0.5  # both halves' models learned
    out = _json(os.path.join(runs["fusion"], "fusion.json"))
    summary = out["summary"]["MLP"]
    assert out["mu_half"] == 0.5
    assert summary["OT+Avg"]["accuracy_at_half_mean"] == acc[("OT+Avg", 0.5)]
    assert 0.5 < summary["moved_plain"] <= 1.0  # independent inits: most neurons move
    assert os.path.getsize(os.path.join(runs["fusion"], "fig31_fusion.png")) > 5000


def test_refuses_non_empty_out(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    out = subprocess.run([sys.executable, "-m", "experiments.r_kept", "--out", str(tmp_path),
                          "--preset", "smoke"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--overwrite" in lines[0]
    assert keep.read_text() == "precious" and sorted(os.listdir(tmp_path)) == ["keep.txt"]


def test_overwrite_replaces_out(tmp_path, capsys):
    (tmp_path / "old.txt").write_text("old")
    assert r_kept.main(["--out", str(tmp_path), "--preset", "smoke", "--overwrite",
                        "--no-progress"]) == 0
    assert not (tmp_path / "old.txt").exists() and (tmp_path / "r_kept.json").exists()
    assert "results in" in capsys.readouterr().out


@pytest.mark.parametrize("argv,word", [(["--preset", "huge"], "preset"),
                                       (["--seed", "x"], "seed"),
                                       (["--seeds", "0", "1"], "--seed"),
                                       ([], "--out")])
def test_bad_arguments_give_one_error_line(tmp_path, capsys, argv, word):
    if word != "--out":
        argv = ["--out", str(tmp_path / "o"), *argv]
    assert r_kept.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and word in err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # a script's smoke preset, trained end to end
def test_universal_runs_every_algorithm_with_and_without_pans(tmp_path):
    from experiments import universal
    from fedjax_pan.run import experiment
    for preset in ("cpu", "paper"):  # every run of the long presets is a valid config
        s = universal.PRESETS[preset]
        for algorithm in s.algorithms:
            for pan in s.pans:
                experiment.validate(universal.run_config(s, algorithm, pan, 0))
    out = str(tmp_path / "u")
    assert universal.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    runs = common.read_csv(os.path.join(out, "universal_runs.csv"))
    assert {(r["algorithm"], r["pan"]) for r in runs} == {
        (a, p) for a in ("fedavg", "moon") for p in ("off", "panmul0.1")}
    table = common.read_csv(os.path.join(out, "universal.csv"))
    for row in table:
        mine = [float(r["final_accuracy"]) for r in runs
                if (r["algorithm"], r["pan"]) == (row["algorithm"], row["pan"])]
        assert float(row["mean"]) == pytest.approx(np.mean(mine))
        summary = _json(os.path.join(out, "runs", f"{row['algorithm']}_{row['pan']}_s0",
                                     "summary.json"))
        assert summary["rounds"] == 1
    pairs = universal.best_vs_off([{**r, "mean": float(r["mean"])} for r in table])
    assert set(pairs) == {"fedavg", "moon"}
    assert os.path.getsize(os.path.join(out, "fig9_universal.png")) > 10_000


def test_fed2_compare_runs_and_tabulates_its_runs(tmp_path):
    from experiments import fed2_compare
    from fedjax_pan.run import experiment
    for preset in ("cpu", "paper"):  # every run of the long presets is a valid config
        s = fed2_compare.PRESETS[preset]
        for method in s.methods:
            for classes in s.classes:
                experiment.validate(fed2_compare.run_config(s, method, classes, 0))
    out = str(tmp_path / "f")
    assert fed2_compare.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    runs = common.read_csv(os.path.join(out, "fed2_runs.csv"))
    assert {r["method"] for r in runs} == {"fedavg", "fed2_pans"}
    upload = {r["method"]: float(r["upload_bytes_per_client"]) for r in runs}
    # Without trimming every client sends its whole model (float32), Fed2 also its 5 group
    # weights; the grouped MLP's block-diagonal layer has fewer parameters.
    from fedjax_pan import models
    plain = models.build("mlp", 10, hidden=[20, 20, 20])
    grouped = models.build("mlp", 10, hidden=[20, 20, 20], grouped={"groups": 5, "depth": 3})
    count = lambda m: models.count_params(models.init(m, jax.random.PRNGKey(0),  # noqa: E731
                                                      (28, 28, 1)))
    assert upload["fedavg"] == 4 * count(plain)
    assert upload["fed2_pans"] == 4 * (count(grouped) + 5) < upload["fedavg"]
    for row in common.read_csv(os.path.join(out, "fed2_compare.csv")):
        mine = [float(r["final_accuracy"]) for r in runs if r["method"] == row["method"]]
        assert float(row["mean"]) == pytest.approx(np.mean(mine))
    config = _json(os.path.join(out, "runs", "fed2_pans_c2_s0", "config.json"))
    assert config["algorithm"] == "fed2" and config["model"]["options"]["grouped"]["groups"] == 5
    assert os.path.getsize(os.path.join(out, "fed2_compare.png")) > 10_000


def test_a_failing_overwrite_keeps_the_old_results(tmp_path, monkeypatch, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.csv").write_text("old results")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("FEDJAX_PAN_FASHION_MNIST_DIR", str(tmp_path / "empty"))
    assert shuffle_accuracy.main(["--out", str(tmp_path / "out"), "--overwrite",
                                  "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FEDJAX_PAN_FASHION_MNIST_DIR" in err[0]
    assert os.listdir(tmp_path / "out") == ["old.csv"]
    assert sorted(os.listdir(tmp_path)) == ["empty", "out"]  # nothing left aside


def test_fed2_compare_reports_diverged_runs_apart():
    from experiments import fed2_compare
    rows = [{"method": "fedavg", "classes": 2, "seed": 0, "final_accuracy": 0.5,
             "diverged": False, "upload_bytes_per_client": 2.0 ** 20},
            {"method": "fedavg", "classes": 2, "seed": 1, "final_accuracy": float("nan"),
             "diverged": True, "upload_bytes_per_client": 3 * 2.0 ** 20},
            {"method": "fed2", "classes": 2, "seed": 0, "final_accuracy": 0.25,
             "diverged": False, "upload_bytes_per_client": 2.0 ** 19},
            {"method": "fed2", "classes": 2, "seed": 1, "final_accuracy": 0.75,
             "diverged": False, "upload_bytes_per_client": 2.0 ** 19}]
    avg, f2 = fed2_compare.summarize(rows)
    assert (avg["mean"], avg["std"], avg["seeds"], avg["diverged"], avg["upload_mib"]) == \
        (0.5, 0.0, 2, 1, 2.0)
    assert (f2["mean"], f2["std"], f2["diverged"], f2["upload_mib"]) == (0.5, 0.25, 0, 0.5)


@pytest.mark.slow  # a script's smoke preset, trained end to end
def test_alignment_methods_runs_and_tabulates_its_runs(tmp_path):
    from experiments import alignment_methods as am
    from fedjax_pan.run import experiment
    for preset in ("cpu", "paper"):  # every run of the long presets is a valid config
        s = am.PRESETS[preset]
        for method in s.methods:
            for setting in s.settings:
                experiment.validate(am.run_config(s, method, setting, 0))
    out = str(tmp_path / "a")
    assert am.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    runs = common.read_csv(os.path.join(out, "alignment_runs.csv"))
    assert [r["method"] for r in runs] == list(am.METHODS)
    by = {r["method"]: r for r in runs}
    # FedAvg sends its 16-12-12-12-10 MLP's float32 delta each way, per client (4).
    from fedjax_pan import models
    n = models.count_params(models.init(models.build("mlp", 10, hidden=[12, 12, 12]),
                                        jax.random.PRNGKey(0), (28, 28, 1)))
    assert float(by["fedavg"]["upload_bytes_per_round"]) == 4 * 4 * n
    # FedMA's layers grow (never beyond the 4 clients' 48 neurons) and it sends more down.
    widths = [int(w) for w in by["fedma"]["hidden_widths"].split("-")]
    assert len(widths) == 3 and all(12 <= w <= 48 for w in widths)
    assert float(by["fedma"]["download_bytes_per_round"]) > float(
        by["fedma"]["upload_bytes_per_round"])
    for row in common.read_csv(os.path.join(out, "alignment_methods.csv")):
        assert float(row["mean"]) == pytest.approx(float(by[row["method"]]["final_accuracy"]))
    config = _json(os.path.join(out, "runs", "K4_R1_a0.5_E1_fedma_s0", "config.json"))
    assert config["algorithm"] == "fedma" and config["pan"]["amplitude"] == 0.0
    assert os.path.getsize(os.path.join(out, "alignment_methods.png")) > 10_000


def test_cifar10_alignment_config_presets_are_valid():
    import importlib.util
    from fedjax_pan.run import experiment
    spec = importlib.util.spec_from_file_location(
        "cifar10_alignment", os.path.join(ROOT, "configs", "cifar10_alignment.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for preset in module.PRESETS:
        cfg = module.get_config(preset)
        assert set(cfg.variants) == {"fedavg", "fedavg_pans", "fedma", "fed2"}
        for name, overrides in cfg.variants.to_dict().items():
            experiment.validate(experiment.apply_overrides(cfg, overrides))
    with pytest.raises(ValueError, match="nosuch"):
        module.get_config("nosuch")


def test_centralised_runs_and_pairs_its_differences(tmp_path):
    from experiments import centralised
    out = str(tmp_path / "c")
    assert centralised.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    runs = common.read_csv(os.path.join(out, "centralised_runs.csv"))
    s = centralised.PRESETS["smoke"]
    assert len(runs) == len(s.seeds) * len(s.optimizers) * len(s.variants)
    assert {r["optimizer"] for r in runs} == {"sgd", "adam"}
    assert all(0.0 <= float(r["test_accuracy"]) <= 1.0 for r in runs)
    assert os.path.getsize(os.path.join(out, "fig30_centralised.png")) > 5000
    # The paired difference by hand: two seeds, on - off per seed, then mean and std.
    rows = [{"optimizer": "sgd", "variant": v, "kind": k, "amplitude": a, "seed": seed,
             "test_accuracy": acc}
            for v, k, a, seed, acc in [("off", "off", 0.0, 0, 0.80), ("off", "off", 0.0, 1, 0.90),
                                       ("x", "mul", 0.1, 0, 0.78), ("x", "mul", 0.1, 1, 0.86)]]
    off, on = centralised.summarize(rows)
    assert (off["mean"], on["seeds"]) == (pytest.approx(0.85), 2)
    assert on["diff_mean"] == pytest.approx(-0.03) and on["diff_std"] == pytest.approx(0.01)
    assert off["diff_mean"] == 0.0


@pytest.mark.slow  # about 11 s: a sweep trained, cut and resumed
def test_sweeps_resume_keeping_finished_runs(tmp_path, capsys):
    from experiments import alignment_methods as am
    out = tmp_path / "a"
    assert am.main(["--out", str(out), "--preset", "smoke", "--no-progress"]) == 0
    first = common.read_csv(str(out / "alignment_runs.csv"))
    finished = out / "runs" / "K4_R1_a0.5_E1_fedavg_s0" / "metrics.jsonl"
    stamp = finished.stat().st_mtime_ns
    # One run lost its summary (as if cut short after its last round): it is completed from
    # its checkpoint; the finished ones are read back, not trained again.
    os.remove(out / "runs" / "K4_R1_a0.5_E1_fedma_s0" / "summary.json")
    assert am.main(["--out", str(out), "--preset", "smoke", "--no-progress", "--resume"]) == 0
    again = common.read_csv(str(out / "alignment_runs.csv"))
    assert finished.stat().st_mtime_ns == stamp
    for a, b in zip(first, again):
        assert (a["method"], a["final_accuracy"]) == (b["method"], b["final_accuracy"])
    assert (out / "runs" / "K4_R1_a0.5_E1_fedma_s0" / "summary.json").exists()
    capsys.readouterr()
    assert am.main(["--out", str(out), "--preset", "smoke", "--resume", "--overwrite"]) == 2
    assert fusion.main(["--out", str(tmp_path / "f"), "--preset", "smoke", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "exclude" in err[0] and "no --resume" in err[1]


def test_seed_results_are_kept_for_resume(tmp_path):
    from experiments.common import Context
    calls = []

    def compute(tag):
        calls.append(tag)
        return {"value": np.float32(len(calls))}

    s = weight_divergence.PRESETS["smoke"]
    ctx = Context(str(tmp_path), 0, "smoke", False, resume=True)
    first = common.seed_result(ctx, 3, s, lambda: compute("a"))
    # Read back under --resume, also when the settings name other seeds (gathered runs).
    other_seeds = dataclasses.replace(s, seeds=(3,))
    assert common.seed_result(ctx, 3, other_seeds, lambda: compute("b")) == first == {
        "value": 1.0}
    # Other settings, or no --resume: computed again.
    changed = dataclasses.replace(s, alphas=(0.5,))
    assert common.seed_result(ctx, 3, changed, lambda: compute("c")) == {"value": 2.0}
    fresh = dataclasses.replace(ctx, resume=False)
    assert common.seed_result(fresh, 3, changed, lambda: compute("d")) == {"value": 3.0}
    assert calls == ["a", "c", "d"]


def test_fields_added_at_their_default_keep_cached_seeds(tmp_path):
    """FLSetup's model fields (added after results were cached) enter the cache key only
    when set: a key written without them still matches; another model does not."""
    from experiments.common import Context
    s = weight_divergence.PRESETS["smoke"]
    key = common.settings_key(s)
    assert "model" not in key["setup"] and "model_options" not in key["setup"]
    assert {k: v for k, v in key["setup"].items()} == {
        k: v for k, v in common.jsonable(s.setup).items() if k not in ("model", "model_options")}
    vgg = dataclasses.replace(s, setup=dataclasses.replace(s.setup, model="vgg9"))
    assert common.settings_key(vgg)["setup"]["model"] == "vgg9"
    ctx = Context(str(tmp_path), 0, "smoke", False, resume=True)
    os.makedirs(tmp_path / "seeds")
    with open(tmp_path / "seeds" / "s0.json", "w") as f:  # as written before the fields
        json.dump({"seed": 0, "settings": {k: v for k, v in key.items() if k != "seeds"},
                   "result": {"value": 7.0}}, f)
    assert common.seed_result(ctx, 0, s, lambda: {"value": 0.0}) == {"value": 7.0}
    assert common.seed_result(ctx, 0, vgg, lambda: {"value": 1.0}) == {"value": 1.0}


@pytest.mark.slow  # a script's smoke preset, trained end to end
def test_sweeps_pair_cells_with_their_reference(tmp_path):
    from experiments import sweeps
    out = str(tmp_path / "s")
    assert sweeps.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    s = sweeps.PRESETS["smoke"]
    runs = common.read_csv(os.path.join(out, "sweeps_smoke_runs.csv"))
    assert len(runs) == len(s.cells) * len(s.seeds)
    table = {r["cell"]: r for r in common.read_csv(os.path.join(out, "sweeps_smoke.csv"))}
    acc = {(r["cell"], r["seed"]): float(r["final_accuracy"]) for r in runs}
    for cell in s.cells[1:]:  # the PAN and the shuffled cell, each against a1_off
        d = [acc[(cell.name, str(k))] - acc[("a1_off", str(k))] for k in s.seeds]
        assert float(table[cell.name]["diff_mean"]) == pytest.approx(np.mean(d))
    assert table["a1_off_nsf1"]["n_sf"] == "1.0"
    with open(os.path.join(out, "runs", "a1_off_nsf1_s0", "config.json")) as f:
        cfg = json.load(f)
    assert cfg["shuffle"]["n_sf"] == 1.0 and cfg["pan"]["amplitude"] == 0.0
    assert os.path.getsize(os.path.join(out, "fig10_smoke.png")) > 5000
    # The other two figure kinds, from a table by hand.
    fake = [{"alpha": 10.0, "amplitude": a, "n_sf": n, "mean": 0.8, "std": 0.01,
             "r_kept": k, "diff_mean": 0.0, "diff_std": 0.0, "diverged": 0, "seeds": 3}
            for a, n, k in [(0.0, 0.0, 1.0), (0.1, 0.0, 1.0), (0.0, 1.0, 0.84)]]
    for figure in ("amplitude", "n_sf"):
        fig = sweeps.plot(dataclasses.replace(s, figure=figure), fake)
        assert common.save_figure(fig, str(tmp_path / f"{figure}.png"))
    # R_kept of Alg. 2's local permutations: 1 without shuffling, below 1 with.
    kept = sweeps.r_kept(s, [0.0, 5.0], seed=0, draws=20)
    assert kept[0.0] == 1.0 and 0.0 < kept[5.0] < 1.0


def test_a_diverged_run_is_kept_by_resume(tmp_path, monkeypatch):
    from experiments import sweeps
    from experiments.common import Context
    from fedjax_pan.run import experiment
    from fedjax_pan.errors import TrainingDiverged
    s = sweeps.PRESETS["smoke"]
    cfg = sweeps.run_config(s, s.cells[0], 0)
    run_dir = str(tmp_path / "r")
    ctx = Context(str(tmp_path), 0, "smoke", False, resume=True)

    def diverge(cfg, run_dir, **kw):
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(cfg.to_json())
        raise TrainingDiverged("training diverged in round 1")

    monkeypatch.setattr(experiment, "train", diverge)
    summary, diverged = common.train_run(cfg, run_dir, ctx, "x")
    assert diverged and math.isnan(summary["final_accuracy"])
    assert "round 1" in _json(os.path.join(run_dir, "diverged.json"))["error"]
    monkeypatch.setattr(experiment, "train", lambda *a, **k: pytest.fail("trained again"))
    assert common.train_run(cfg, run_dir, ctx, "x")[1] is True


def test_seeds_replace_the_presets_where_a_script_runs_several(tmp_path, capsys):
    from experiments import sweeps
    s = sweeps.PRESETS["smoke"]
    assert common.with_seeds("sweeps", s, None, [5, 2]).seeds == (5, 2)
    assert common.with_seeds("sweeps", s, None, None) is s
    for seed, seeds, word in [(3, None, "--seeds, not --seed"), (None, [1, 1], "distinct")]:
        with pytest.raises(common.UsageError, match=word):
            common.with_seeds("sweeps", s, seed, seeds)
    assert sweeps.main(["--out", str(tmp_path / "w"), "--preset", "smoke", "--seed", "1"]) == 2
    assert "--seeds" in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_sweeps_presets_are_valid_configs():
    from experiments import sweeps
    from fedjax_pan.run import experiment
    for name, s in sweeps.PRESETS.items():
        for cell in s.cells:
            cfg = sweeps.run_config(s, cell, seed=0)
            experiment.validate(cfg)
            assert (cfg.partition.alpha, cfg.shuffle.n_sf) == (cell.alpha, cell.n_sf)
        # Every PAN or shuffling effect has its reference cell in the preset.
        assert all(c.reference in s.cells for c in s.cells), name


def test_fl_through_a_workdir_equals_the_in_memory_run(tmp_path):
    from experiments.common import Context
    s = weight_divergence.PRESETS["smoke"]
    cfg = common.fl_config(s.setup, common.PANS_ON, seed=1)
    # The reference: the library's rounds in memory, no workdir.
    from fedjax_pan.run import experiment
    exp = experiment.build(cfg)
    state, history = experiment.train_rounds(exp, exp.simulation.init(exp.variables),
                                             cfg.rounds, progress=False)
    info = {"train_loss": [float(h["train_loss"]) for h in history],
            "test_accuracy": float(exp.evaluate(common.global_variables(exp, state))["accuracy"])}
    ctx = Context(str(tmp_path), 0, "smoke", False, resume=True)
    run_dir = str(tmp_path / "r")
    for _ in range(2):  # trained, then read back from its last checkpoint
        exp2, state2, info2 = common.train_fl_run(cfg, run_dir, ctx)
        assert state2.round == state.round == cfg.rounds
        for a, b in zip(jax.tree_util.tree_leaves(common.global_variables(exp, state)),
                        jax.tree_util.tree_leaves(common.global_variables(exp2, state2))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert info2["test_accuracy"] == info["test_accuracy"]
        np.testing.assert_allclose(info2["train_loss"], info["train_loss"], rtol=1e-6)
    assert len(os.listdir(os.path.join(run_dir, "checkpoints"))) >= 1


def test_personalized_table_from_its_runs(tmp_path):
    """Every run of the long presets is a valid config; the smoke table's figures are the
    mean of each run's last 3 evaluations, and costs are relative to FedAvg's."""
    from experiments import personalized
    from fedjax_pan.run import experiment
    for preset in ("cpu", "cpu_k100", "paper", "fedala_table"):
        s = personalized.PRESETS[preset]
        for skew in s.skews:
            for k in s.clients:
                for a in s.algorithms:
                    experiment.validate(personalized.run_config(s, skew, k, a, 0))
    out = str(tmp_path / "p")
    assert personalized.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    table = common.read_csv(os.path.join(out, "personalized.csv"))
    assert [r["algorithm"] for r in table] == ["fedavg", "fedper"]
    for row in table:
        curve = common.read_curve(os.path.join(out, "runs",
                                               f"pat_K6_{row['algorithm']}_s0"))
        assert len(curve) == 2
        for m in personalized.METRICS:
            assert float(row[m]) == pytest.approx(np.mean([r[m] for r in curve[-3:]]))
        assert 0 <= float(row["client_accuracy_worst10"]) <= float(
            row["client_accuracy_mean"]) <= 1
    assert float(table[0]["cost_vs_fedavg"]) == 1.0
    assert os.path.getsize(os.path.join(out, "personalized.png")) > 10_000
    assert os.path.getsize(os.path.join(out, "personalized_curves.png")) > 10_000
    # Paper 001's FedALA table: its 14 methods and 8 columns, ours at K = 20 (not in the
    # smoke run: 'not run'), the paper's numbers beside them.
    layout = common.read_csv(os.path.join(out, "fedala_table.csv"))
    assert [r["method"] for r in layout] == [m for m, _ in personalized.PAPER_METHODS]
    assert all(r["pat here"] == r["dir here"] == "not run" for r in layout)
    assert float(layout[0]["dir AG News paper"]) == 79.57
    assert layout[-1]["dir TINY here"] == "not run"
    rows = personalized.fedala_table([
        {"setting": "pat_K20", "algorithm": "fedavg", "pfl_accuracy": 0.63156},
        {"setting": "dir_K20", "algorithm": "fedavg", "pfl_accuracy": float("nan")}])
    assert (rows[0]["pat here"], rows[0]["dir here"]) == ("63.16", "diverged")
    markdown = personalized.fedala_markdown(rows, "Fashion-MNIST")
    assert "| FedAvg | 63.16 | diverged | 97.93 / not run |" in markdown


def test_personalized_gives_pfllibs_local_epochs_to_fedpac_fedda_and_fedbabu():
    """PFLlib's clientpac.py: 1 head epoch, then E body epochs; clientda.py: E + E;
    clientbabu.py: 10 fine-tuning epochs (main.py's -fte)."""
    from experiments import personalized
    for epochs in (1.0, 2.0):
        s = dataclasses.replace(personalized.PRESETS["cpu"], epochs=epochs)
        pac = personalized.run_config(s, "pat", 20, "fedpac", 0)
        head = pac.local.epochs * pac.fedpac.head_fraction
        assert (head, pac.local.epochs - head) == pytest.approx((1.0, epochs))
        da = personalized.run_config(s, "pat", 20, "fedda", 0)
        head = da.local.epochs * da.fedda.head_fraction
        assert (head, da.local.epochs - head) == pytest.approx((epochs, epochs))
        babu = personalized.run_config(s, "pat", 20, "fedbabu", 0)
        assert babu.eval.finetune_epochs == 10.0 and babu.local.epochs == epochs
        proto = personalized.run_config(s, "pat", 20, "fedproto", 0)
        assert proto.local.epochs == epochs  # its class means come from training
        assert proto.aggregation.weights == personalized.WEIGHTS == "uniform"


def test_algorithms_can_be_picked_from_the_command_line(capsys):
    from experiments import personalized, r_kept
    s = personalized.PRESETS["smoke"]
    picked = common.with_algorithms("personalized", s, ["fedamp", "fedavg_c"])
    assert picked.algorithms == ("fedamp", "fedavg_c") and picked.clients == s.clients
    assert common.with_algorithms("personalized", s, None) is s
    for bad in (["nosuch"], ["fedamp", "fedamp"]):
        with pytest.raises(common.UsageError, match=r"--algorithms must be distinct names"):
            common.with_algorithms("personalized", s, bad)
    assert r_kept.main(["--out", "unused", "--algorithms", "fedavg"]) == 2
    assert "compares no algorithms" in capsys.readouterr().err


def test_sigterm_saves_the_round_and_resume_finishes_the_sweep(tmp_path, monkeypatch, capsys):
    import signal as signal_lib

    from experiments import personalized
    from fedjax_pan.engine.simulation import Simulation
    out = str(tmp_path / "p")
    # The smoke preset trains fedavg then fedper, 2 rounds each, a checkpoint every round:
    # the 4th round is fedper's second.
    before = signal_lib.getsignal(signal_lib.SIGTERM)
    signal_on_call(monkeypatch, Simulation, "round", signal_lib.SIGTERM, 4)
    assert personalized.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 143
    assert signal_lib.getsignal(signal_lib.SIGTERM) is before  # the handler is given back
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and re.fullmatch(
        r"error: interrupted in round 2; round 1 is saved in \S+pat_K6_fedper_s0; continue "
        r"with --resume", err[0]), err
    run = os.path.join(out, "runs", "pat_K6_fedper_s0")
    assert [r["round"] for r in common.read_curve(run)] == [1]
    assert os.listdir(os.path.join(run, "checkpoints")) == ["1"]
    monkeypatch.undo()
    finished = os.path.join(out, "runs", "pat_K6_fedavg_s0", "metrics.jsonl")
    stamp = os.stat(finished).st_mtime_ns
    assert personalized.main(["--out", out, "--preset", "smoke", "--no-progress",
                              "--resume"]) == 0
    assert [r["round"] for r in common.read_curve(run)] == [1, 2]
    assert os.stat(finished).st_mtime_ns == stamp  # the finished run was read back
    assert os.path.isfile(os.path.join(out, "personalized.png"))


def test_ctrl_c_while_a_curve_is_drawn_finishes_it_first(tmp_path, monkeypatch, capsys):
    import signal as signal_lib

    from experiments import personalized
    from fedjax_pan.run import reporting
    out = str(tmp_path / "p")
    signal_on_call(monkeypatch, reporting, "plot_curves", signal_lib.SIGINT, 1)
    assert personalized.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and re.fullmatch(r"error: interrupted; \S+ keeps the rounds saved so "
                                          r"far; continue with --resume", err[0]), err
    run = os.path.join(out, "runs", "pat_K6_fedavg_s0")
    assert os.path.getsize(os.path.join(run, "curve.png")) > 1000
    assert os.path.isfile(os.path.join(run, "summary.json"))
    monkeypatch.undo()
    # A run an older version left without its curve is finished again, which draws it.
    os.remove(os.path.join(run, "curve.png"))
    assert personalized.main(["--out", out, "--preset", "smoke", "--no-progress",
                              "--resume"]) == 0
    assert os.path.getsize(os.path.join(run, "curve.png")) > 1000


@pytest.mark.slow  # about five runs of the cheapest sweep's smoke preset (1-3 minutes)
def test_a_sigterm_at_any_moment_of_a_script_ends_it_with_143(tmp_path):
    """SIGTERMs timed across a whole script run (data, two trainings, tables and figures):
    none is lost (a handler that raised lost one now and then in a garbage-collection
    callback, and the script went on to exit 0). Each ends the script with 143 and one
    `error:` line, or, before the script installed its handler, with the default action."""
    import signal as signal_lib
    import time

    command = [sys.executable, "-m", "experiments.personalized", "--preset", "smoke",
               "--no-progress", "--out"]
    start = time.time()
    subprocess.run([*command, str(tmp_path / "whole")], cwd=ROOT, check=True,
                   capture_output=True, timeout=600)
    duration = time.time() - start
    outcomes = []
    for i in range(8):
        proc = subprocess.Popen([*command, str(tmp_path / f"cut{i}")], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:  # its stdout and stderr are a few lines: the pipes cannot fill meanwhile
            proc.wait(timeout=duration * (0.05 + 0.8 * i / 7))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal_lib.SIGTERM)
        else:  # faster than the measured run: finished before its signal
            outcomes.append("finished")
            continue
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # ignored the signal: leave no process behind
            proc.kill()
            proc.communicate()
            raise
        lines = [line for line in err.splitlines() if line.strip()]
        if proc.returncode == -signal_lib.SIGTERM:  # before the handler was installed
            outcomes.append("killed")
            continue
        assert proc.returncode == 143, (i, proc.returncode, err)
        assert len(lines) == 1 and lines[0].startswith("error: interrupted"), (i, err)
        outcomes.append("143")
    assert outcomes.count("143") >= 4, outcomes  # most signals met the handler


def test_robustness_configs_and_table_by_hand():
    """Every run of the long presets is a valid config with what its scenario names; the
    time to target and the summary are worked out by hand."""
    from experiments import robustness
    from fedjax_pan.run import experiment
    for preset in ("cpu", "paper", "smoke", "siren", "authors"):
        s = robustness.PRESETS[preset]
        for job in robustness.jobs(s):
            cfg = robustness.run_config(s, job)
            experiment.validate(cfg)
            assert (cfg.straggler.max_delay > 0) == (job.scenario in ("stragglers", "both"))
            assert (cfg.attack.kind != "none") == (job.attack != "none")
            # The SageFlow authors' protocol: attackers drawn per round, delays 0, 1, 2
            # forced, their lr decay (adversaries only) and backdoor settings.
            authors = preset == "authors"
            assert (cfg.attack.draw == "per_round") == authors
            assert cfg.straggler.forced == ((0, 1, 2) if authors and
                                            cfg.straggler.max_delay else ())
            sync = authors and job.scenario == "adversaries"
            assert (cfg.optimizer.warmup == "halving") == (sync and job.attack != "backdoor")
            if sync and job.attack == "backdoor":
                assert (cfg.participation, cfg.local.batch_size, cfg.attack.start_round,
                        cfg.aggregation.sageflow.delta) == (0.1, 64, 10, 5.0)
    assert {j.method for j in robustness.jobs(robustness.PRESETS["siren"])} == {"siren"}
    ours = robustness.jobs(robustness.PRESETS["sageflow"])
    assert {j.method for j in ours} == {"sageflow"} and len(ours) == 12
    assert all(robustness.run_config(robustness.PRESETS["sageflow"], j).attack.draw == "fixed"
               for j in ours)
    s = robustness.PRESETS["authors"]
    job = robustness.Job("adversaries", "backdoor", "zeno", 0)
    assert robustness.run_config(s, job).aggregation.byzantine == 1  # int(10 x 0.1)
    s = robustness.PRESETS["cpu"]
    names = [(j.scenario, j.attack, j.method) for j in robustness.jobs(s) if j.seed == 0]
    # Krum cannot run with 8 of 10 clients malicious (it needs n > f + 2): left out.
    assert ("byzantine", "sign_flip_80", "krum") not in names
    assert ("byzantine", "sign_flip_40", "krum") in names
    assert ("byzantine", "label_flip_80", "siren") in names
    job = robustness.Job("adversaries", "model", "multi_krum", 0)
    assert robustness.run_config(s, job).aggregation.byzantine == 4  # 20% of 20 a round
    curve = [{"round": 1, "test_accuracy": 0.3, "sim_time": 3.0},
             {"round": 2, "test_accuracy": 0.65, "sim_time": 5.0},
             {"round": 3, "test_accuracy": 0.62, "sim_time": 6.0}]
    assert robustness.time_to(curve, 0.6) == 5.0
    assert np.isnan(robustness.time_to(curve, 0.9))
    rows = [robustness.run_row(robustness.Job("both", "data", "sageflow", seed), c, False, 0.6)
            for seed, c in ((0, curve), (1, [dict(r, test_accuracy=0.5) for r in curve]))]
    (rec,) = robustness.summarize(rows)
    assert rec["accuracy"] == pytest.approx((np.mean([0.3, 0.65, 0.62]) + 0.5) / 2)
    assert rec["time_to_target"] == 5.0 and rec["reached"] == 1


@pytest.mark.slow  # about 80 s
def test_robustness_smoke_writes_its_table(tmp_path):
    from experiments import robustness
    out = str(tmp_path / "r")
    assert robustness.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    table = common.read_csv(os.path.join(out, "robustness.csv"))
    scenarios = {r["scenario"] for r in table}
    assert scenarios == {"stragglers", "adversaries", "both", "byzantine"}
    for r in table:
        curve = common.read_curve(os.path.join(out, "runs", f"{r['scenario']}_{r['attack']}_"
                                                         f"{r['method']}_s0"))
        assert float(r["accuracy"]) == pytest.approx(
            np.mean([c["test_accuracy"] for c in curve[-5:]]))
        if r["scenario"] in ("stragglers", "both"):
            assert all("sim_time" in c for c in curve)
    for name in ("robustness.png", "robustness_curves.png"):
        assert os.path.getsize(os.path.join(out, name)) > 10_000


def test_compression_configs_and_table_by_hand():
    """Every run of each preset is a valid config setting what its method names; rows and
    the summary are worked out by hand against FedAvg's run of the same split."""
    from experiments import compression
    from fedjax_pan.run import experiment
    for preset in ("cpu", "paper", "smoke"):
        s = compression.PRESETS[preset]
        for job in compression.jobs(s, s.datasets):
            cfg = compression.run_config(s, job)
            experiment.validate(cfg)
            assert (cfg.compression.upload.method != "none") == (job.method != "fedavg")
    s = compression.PRESETS["cpu"]
    assert len(compression.jobs(s, s.datasets)) == 15 * 5
    cfg = compression.run_config(s, compression.Job("fashion_mnist", "dir25", "premask_50", 0))
    assert (cfg.partition.alpha, cfg.compression.mask_before) == (0.25, "magnitude")

    def curve(accs, up, down):
        return [{"round": r + 1, "test_accuracy": a, "upload_bytes_total": up * (r + 1),
                 "download_bytes_total": down * (r + 1)} for r, a in enumerate(accs)]
    todo = [compression.Job("d", "iid", m, 0) for m in ("fedavg", "top_k_10")]
    results = [(None, False, curve([0.5, 0.8, 0.8, 0.8], 100.0, 100.0)),
               (None, False, curve([0.2, 0.7, 0.78, 0.79], 10.0, 100.0))]
    base, top = compression.run_rows(todo, results, s)
    assert base["volume"] == 1.0 and base["rounds_to_target"] == 2.0
    assert top["accuracy"] == pytest.approx((0.7 + 0.78 + 0.79) / 3)
    assert top["accuracy_kept"] == pytest.approx(top["accuracy"] / 0.8)
    assert top["rounds_to_target"] == 3.0  # first >= 0.95 x 0.8 = 0.76
    assert top["volume"] == pytest.approx(440 / 800) and top["upload_volume"] == 0.1
    lines = compression.report(compression.summarize([base, top]), s, {"mnist": "no files"})
    assert lines[0] == "not run: mnist (no files)"
    kept = 100 * top["accuracy"] / 0.8
    assert f"  {'top_k_10':<16}{kept:13.1f}%{45.0:12.1f}%{90.0:13.1f}%" in lines


def test_privacy_configs_and_rows():
    from experiments import privacy
    from fedjax_pan.run import experiment
    for preset in ("cpu", "paper", "smoke"):
        s = privacy.PRESETS[preset]
        for job in privacy.jobs(s):
            cfg = privacy.run_config(s, job)
            experiment.validate(cfg)
            assert (cfg.privacy.clip > 0) == (job.mode != "none")
            assert cfg.privacy.adaptive == (job.mode == "adaptive")
            assert cfg.sampling == "poisson"
    row = privacy.run_row(privacy.Job("fixed", 1.0, 0),
                          [{"round": r, "test_accuracy": a, "dp_epsilon": e} for r, a, e in
                           ((5, 0.5, 1.0), (10, 0.6, 1.5), (15, 0.7, 2.0), (20, 0.8, 2.4))],
                          False)
    assert row["accuracy"] == pytest.approx(0.7) and row["epsilon"] == 2.4


@pytest.mark.slow  # about 60 s
def test_compression_and_privacy_smoke_write_their_tables(tmp_path, capsys):
    from experiments import compression, privacy
    out = str(tmp_path / "c")
    assert compression.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    table = common.read_csv(os.path.join(out, "compression.csv"))
    assert {r["method"] for r in table} == set(compression.PRESETS["smoke"].methods)
    for r in table:
        assert float(r["volume"]) <= 1.0 if r["method"] != "fedavg" else \
            float(r["volume"]) == 1.0
    assert os.path.getsize(os.path.join(out, "compression.png")) > 10_000
    printed = capsys.readouterr().out
    assert "accuracy kept" in printed and "bytes saved" in printed
    out = str(tmp_path / "p")
    assert privacy.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    table = common.read_csv(os.path.join(out, "privacy.csv"))
    eps = {(r["mode"], float(r["noise_multiplier"])): float(r["epsilon"]) for r in table}
    assert math.isinf(eps[("none", 0.0)]) and math.isinf(eps[("fixed", 0.0)])
    assert 0 < eps[("fixed", 1.0)] < eps[("adaptive", 0.5)] < math.inf
    assert "epsilon" in capsys.readouterr().out


def test_flchain_configs_and_rows():
    from experiments import flchain
    from fedjax_pan.run import experiment
    for preset in ("cpu", "smoke"):
        s = flchain.PRESETS[preset]
        runs = flchain.tamper_configs(s, 0) + flchain.cost_configs(s, 0)
        for _, cfg in runs:
            experiment.validate(cfg)
            assert cfg.algorithm == "flchain"
        names = [n for n, _ in runs]
        assert names[:3] == list(flchain.TAMPER_RUNS) and len(set(names)) == len(names)
        central = dict(runs)["central"].flchain
        assert central.validators == 1 and central.faulty == 1
        # Runs with faults cover a full rotation of proposers.
        for name, cfg in runs:
            if cfg.flchain.faulty and name.startswith("cost"):
                assert cfg.rounds >= cfg.flchain.validators
    curve = [{"round": r, "test_accuracy": a, "sim_rejected": j, "sim_time": 2.0 * r}
             for r, a, j in ((1, 0.5, 0), (2, 0.6, 1), (3, 0.2, 0), (4, 0.3, 0))]
    row = flchain.tamper_row("central", curve, flchain.Settings(tamper_from=2), "verified")
    assert row["accuracy_before"] == 0.6 and row["min_accuracy_after"] == 0.2
    assert row["final_accuracy"] == 0.3 and row["rejected"] == 1 and row["sim_seconds"] == 8.0


@pytest.mark.slow  # about 15 s
def test_flchain_smoke_writes_its_tables(tmp_path, capsys):
    from experiments import flchain
    out = str(tmp_path / "f")
    assert flchain.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    rows = {r["run"]: r for r in common.read_csv(os.path.join(out, "flchain_tamper.csv"))}
    assert rows["honest"]["audit"] == rows["chain"]["audit"] == "verified"
    assert "state root is not the aggregate" in rows["central"]["audit"]
    assert int(rows["chain"]["rejected"]) >= 1
    cost = common.read_csv(os.path.join(out, "flchain_cost.csv"))
    one = [r for r in cost if r["validators"] == "1"]
    assert all(float(r["consensus_seconds"]) == 0.0 for r in one)
    assert os.path.getsize(os.path.join(out, "flchain.png")) > 10_000
    assert "audit" in capsys.readouterr().out


def test_fair_configs_and_rows():
    """Every run of each preset is a valid config with what its variant names; the costs
    the script prices all_clients at are the recruiter's; rows, utilities, the accuracy at
    equal money and the summary are worked out by hand."""
    from experiments import fair
    from fedjax_pan.algorithms import recruitment
    from fedjax_pan.run import experiment
    for preset in ("cpu", "paper", "smoke"):
        s = fair.PRESETS[preset]
        for job in fair.jobs(s):
            cfg = fair.run_config(s, job)
            experiment.validate(cfg)
            assert cfg.partition.noise_rate == job.noise_rate and cfg.eval.every == 1
            assert cfg.recruitment.policy == {"fair": "fair", "fair_selection": "fair",
                                              "all_clients": "none"}.get(job.variant,
                                                                         "random")
            assert (cfg.aggregation.rule == "auto_weights") == (
                job.variant in ("fair", "fair_selection", "auto_weights_random"))
            assert cfg.aggregation.auto_weights.apply == (job.variant != "fair_selection")
            assert cfg.aggregation.weights == "num_examples"
    s = fair.PRESETS["cpu"]
    assert len(fair.jobs(s)) == 5 * 3 * 5
    # The recruiter records its winners' costs of the round: round_costs draws the same.
    cfg = fair.run_config(s, fair.Job("random_budget", 0.5, 3))
    rec = recruitment.recruiter(cfg.recruitment, cfg.seed)
    ids, _, fields = rec.select(rec.init(20), 7)
    costs, bids = fair.round_costs(cfg, 7, 20)
    np.testing.assert_array_equal(fields["recruit_costs"], costs[ids])
    np.testing.assert_array_equal(fields["recruit_bids"], bids[ids])
    assert 0 < (bids > costs).sum() < 20  # some clients strategic, not all

    noisy = np.array([True, False, False, True])
    curve = [{"round": 1, "test_accuracy": 0.4, "recruit_clients": [0, 1],
              "recruit_payments": [1.5, 2.0], "recruit_costs": [1.0, 1.5],
              "recruit_spent_total": 3.5},
             {"round": 2, "test_accuracy": 0.6, "recruit_clients": [1, 2, 3],
              "recruit_payments": [1.0, 1.0, 2.0], "recruit_costs": [1.0, 0.5, 1.5],
              "recruit_spent_total": 7.5}]
    rows = fair.curve_rows(curve, noisy)
    assert [(r["spent_total"], r["recruited"], r["noisy_share_selected"]) for r in rows] == [
        (3.5, 2, 0.5), (7.5, 3, pytest.approx(1 / 3))]
    utility, count = fair.client_utilities(curve, 4)
    np.testing.assert_allclose(utility, [0.5, 0.5, 0.5, 0.5])
    np.testing.assert_array_equal(count, [1, 2, 1, 1])
    strategic = np.array([False, False, True, False])
    job = fair.Job("fair", 0.5, 0)
    one = fair.run_summary(job, rows, np.array([1.0, 2.0, 3.0, 5.0]), noisy, strategic)
    assert one["final_accuracy"] == pytest.approx(0.5) and one["spent_total"] == 7.5
    assert one["noisy_selected"] == pytest.approx(2 / 5)  # client 0, then client 3
    assert (one["utility_truthful"], one["utility_strategic"]) == (pytest.approx(8 / 3), 3.0)
    assert (one["utility_noisy"], one["utility_clean"]) == (3.0, 2.5)
    # Without recruitment: every client every round, priced at every client's cost.
    everyone = fair.curve_rows([{"round": 1, "test_accuracy": 0.3},
                                {"round": 2, "test_accuracy": 0.5}], noisy, [6.0, 5.0])
    assert [(r["spent_total"], r["recruited"], r["noisy_share_selected"])
            for r in everyone] == [(6.0, 4, 0.5), (11.0, 4, 0.5)]
    assert fair.client_utilities([{"round": 1}], 4)[1].tolist() == [1, 1, 1, 1]
    assert fair.accuracy_at(everyone, 7.5) == 0.3 and math.isnan(fair.accuracy_at(everyone, 5))
    other = dict(one, variant="all_clients", spent_total=11.0, final_accuracy=0.4)
    runs = fair.with_equal_money([one, other], [rows, everyone])
    assert [r["equal_money"] for r in runs] == [7.5, 7.5]
    assert [r["accuracy_at_equal_money"] for r in runs] == [0.6, 0.3]
    seed1 = dict(runs[0], seed=1, final_accuracy=0.7, utility_strategic=float("nan"))
    table = {r["variant"]: r for r in fair.summarize([*runs, seed1])}
    assert table["fair"]["seeds"] == 2 and table["all_clients"]["seeds"] == 1
    assert table["fair"]["final_accuracy"] == pytest.approx(0.6)
    assert table["fair"]["final_accuracy_std"] == pytest.approx(0.1)
    assert table["fair"]["utility_strategic"] == 3.0  # a seed without strategic clients


@pytest.mark.slow  # about 20 s
def test_fair_smoke_writes_its_tables(tmp_path, capsys):
    from experiments import fair
    from fedjax_pan import data as data_lib
    out = str(tmp_path / "f")
    assert fair.main(["--out", out, "--preset", "smoke", "--no-progress"]) == 0
    s = fair.PRESETS["smoke"]
    rounds = common.read_csv(os.path.join(out, "rounds.csv"))
    clients = common.read_csv(os.path.join(out, "clients.csv"))
    table = {r["variant"]: r for r in common.read_csv(os.path.join(out, "summary.csv"))}
    assert len(rounds) == len(fair.jobs(s)) * s.rounds and set(table) == set(fair.VARIANTS)
    noisy = data_lib.noisy_clients(s.clients, s.noisy_share, 0)
    curves = {}
    for job in fair.jobs(s):
        curve = curves[job.variant] = common.read_curve(os.path.join(out, "runs", job.name))
        mine = [r for r in rounds if r["variant"] == job.variant]
        assert float(table[job.variant]["final_accuracy"]) == pytest.approx(
            np.mean([c["test_accuracy"] for c in curve[-5:]]))
        utility = {int(c["client"]): float(c["utility"]) for c in clients
                   if c["variant"] == job.variant}
        if job.variant == "all_clients":  # every cost of every round paid, nothing more
            cfg = fair.run_config(s, job)
            money = sum(fair.round_costs(cfg, r, s.clients)[0].sum() for r in range(s.rounds))
            assert float(mine[-1]["spent_total"]) == pytest.approx(money)
            assert set(utility.values()) == {0.0}
            continue
        gain = np.zeros(s.clients)
        for c, r in zip(curve, mine):  # within budget; the noisy share of the recruits
            assert c["recruit_spent"] <= s.budget + 1e-9 and c["recruit_count"] > 0
            ids = c["recruit_clients"]
            assert float(r["noisy_share_selected"]) == pytest.approx(noisy[ids].mean())
            np.add.at(gain, ids, np.subtract(c["recruit_payments"], c["recruit_costs"]))
        np.testing.assert_allclose([utility[i] for i in range(s.clients)], gain)
        truthful = [utility[int(c["client"])] for c in clients
                    if c["variant"] == job.variant and c["strategic"] == "False"]
        if job.variant.startswith("fair"):  # individually rational: truthful bids never lose
            assert min(truthful) >= 0 and max(truthful) > 0
        else:  # paid their bids, which are their costs
            assert set(truthful) == {0.0}
    # The random order and its budget are shared: both random variants recruit alike.
    assert [c["recruit_clients"] for c in curves["random_budget"]] == [
        c["recruit_clients"] for c in curves["auto_weights_random"]]
    assert os.path.getsize(os.path.join(out, "fair.png")) > 10_000
    assert "at equal $" in capsys.readouterr().out
