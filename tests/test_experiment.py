"""Config-driven runs: resume equals an uninterrupted run, bad input, divergence, workdirs."""

import contextlib
import errno
import importlib.util
import json
import os
import re
import shutil

import numpy as np
import pytest

from conftest import ROOT, signal_on_call
from fedjax_pan import data
from fedjax_pan.run import assembly, experiment, training
from fedjax_pan.config import defaults
from fedjax_pan.engine import count_compiles


def config(preset="smoke", **changes):
    spec = importlib.util.spec_from_file_location("fmnist_mlp",
                                                  os.path.join(ROOT, "configs", "fmnist_mlp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(preset)
    cfg.dataset.name = "synthetic"  # fast and always available
    # The paper's MLP with 64-wide hidden layers: what these tests check (resume, files,
    # signals) does not depend on the width, and checkpoints of per-client states shrink.
    cfg.model.options = {"hidden": [64, 64, 64]}
    return defaults.set_keys(cfg, {k.replace("__", "."): v for k, v in changes.items()})


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in f]


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(config(rounds=4, checkpoint_every=2), full, progress=False)
    experiment.train(config(rounds=3, checkpoint_every=2), part, progress=False)
    # Crash after round 3 was logged but before its checkpoint landed: drop that checkpoint.
    shutil.rmtree(os.path.join(part, "checkpoints", "3"))
    assert len(metrics(part)) == 3
    summary = experiment.train(config(rounds=4, checkpoint_every=2), part, resume=True,
                               progress=False)
    assert metrics(part) == metrics(full)
    assert summary["rounds"] == 4 and len(metrics(full)) == 4
    assert summary["compiles_after_first_round"] == 0


def test_resume_refuses_a_different_config(tmp_path):
    workdir = str(tmp_path / "w")
    experiment.train(config(rounds=1), workdir, progress=False)
    with pytest.raises(experiment.ConfigError, match="partition"):
        experiment.train(config(rounds=2, partition__alpha=0.5), workdir, resume=True,
                         progress=False)


def test_options_added_since_a_run_leave_it_resumable(tmp_path):
    """A run saved before an option existed (its config.json lacks it) resumes when the
    option is at its default, and refuses naming the option otherwise."""
    workdir = str(tmp_path / "w")
    experiment.train(config(rounds=1), workdir, progress=False)
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        saved = json.load(f)
    del saved["pfedme"], saved["partition"]["test_fraction"]  # as an older version wrote
    with open(path, "w") as f:
        json.dump(saved, f)
    assert experiment.config_changes(saved, json.loads(config(rounds=2).to_json())) == \
        ["rounds"]
    with pytest.raises(experiment.ConfigError, match=r"changed: pfedme\)"):
        experiment.train(config(rounds=2, pfedme__lam=1.0), workdir, resume=True,
                         progress=False)
    with pytest.raises(experiment.ConfigError, match=r"changed: partition\.test_fraction\)"):
        experiment.train(config(rounds=2, partition__test_fraction=0.25), workdir,
                         resume=True, progress=False)
    experiment.train(config(rounds=2), workdir, resume=True, progress=False)
    assert len(metrics(workdir)) == 2


@pytest.mark.parametrize("changes,match", [
    (dict(partition__alpha=0.0), "alpha"), (dict(partition__alpha=-1.0), "alpha"),
    (dict(participation=0.0), "participation"), (dict(participation=1.2), "participation"),
    (dict(partition__num_clients=5000), "exceeds"), (dict(model__name="vgg7"), "vgg7"),
    (dict(dataset__name="imagenet"), "imagenet"), (dict(execution__strategy="gpu"), "gpu"),
    (dict(partition__scheme="shards"), "shards"), (dict(local__batch_size=0), "batch_size"),
    (dict(pan__kind="pow"), "pow"), (dict(model__norm="layer"), "layer"),
    (dict(dataset__augment="mixup"), "mixup"),
    (dict(partition__test_fraction=1.0), "test_fraction"),
    (dict(dataset__normalization="authors"), "normalization='authors' has constants for "
                                             "cifar10, cifar100, not 'synthetic'"),
])
def test_bad_configs_fail_before_touching_the_workdir(tmp_path, changes, match):
    workdir = tmp_path / "w"
    with pytest.raises(experiment.ConfigError, match=match):
        experiment.train(config(**changes), str(workdir), progress=False)
    assert not workdir.exists()


def test_non_empty_workdir_is_refused_and_kept(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(experiment.ConfigError, match="not empty"):
        experiment.train(config(rounds=1), str(tmp_path), progress=False)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    experiment.train(config(rounds=1), str(tmp_path), overwrite=True, progress=False)
    assert not (tmp_path / "notes.txt").exists()
    assert {"config.json", "metrics.jsonl", "summary.json", "curve.png", "checkpoints"} <= \
        set(os.listdir(tmp_path))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    # The largest lr and weight decay the rules allow grow the weights 1000-fold a step.
    cfg = config(rounds=5, optimizer__lr=100.0, optimizer__weight_decay=10.0,
                 optimizer__grad_clip=0.0, max_train_loss=1e30, checkpoint_every=10)
    with pytest.raises(experiment.TrainingDiverged, match=r"in round (\d+)") as info:
        experiment.train(cfg, str(tmp_path), progress=False)
    bad = int(re.search(r"in round (\d+)", str(info.value)).group(1))
    # No periodic checkpoint was due, so the state before the bad round is what is kept.
    assert os.listdir(tmp_path / "checkpoints") == [str(bad - 1)]
    assert f"round {bad - 1}" in str(info.value)
    assert len(metrics(tmp_path)) == bad - 1


@pytest.mark.slow  # about 12 s (`make run`, the main job, runs variants too)
def test_variants_write_a_comparison(tmp_path):
    cfg = config("compare", rounds=1, partition__num_clients=10, local__epochs=0.5)
    summaries = experiment.run(cfg, str(tmp_path), progress=False)
    names = {f"pans_{side}_s{seed}" for side in ("off", "on") for seed in (0, 1, 2)}
    assert set(summaries) == names
    assert {"comparison.json", "comparison.csv", "comparison_seeds.json",
            "curves.png"} <= set(os.listdir(tmp_path))
    # Same seed and data: only the PANs differ, and they change the result; another seed
    # is another run.
    assert metrics(tmp_path / "pans_off_s0") != metrics(tmp_path / "pans_on_s0")
    assert metrics(tmp_path / "pans_off_s0") != metrics(tmp_path / "pans_off_s1")
    with open(tmp_path / "comparison_seeds.json") as f:
        off, on = json.load(f)
    acc = {n: s["final_accuracy"] for n, s in summaries.items()}
    diffs = [acc[f"pans_on_s{k}"] - acc[f"pans_off_s{k}"] for k in range(3)]
    assert (off["group"], on["group"], on["seeds"]) == ("pans_off", "pans_on", [0, 1, 2])
    assert on["mean"] == pytest.approx(np.mean([acc[f"pans_on_s{k}"] for k in range(3)]))
    assert on["diff_mean"] == pytest.approx(np.mean(diffs))
    assert on["diff_std"] == pytest.approx(np.std(diffs))
    assert off["diff_mean"] == 0.0
    table = experiment.format_table(summaries,
                                    experiment.seed_groups(experiment.variant_configs(cfg)))
    assert "pans_on_s2" in table and "pans_on - pans_off" in table


def test_paired_stats_by_hand():
    st = experiment.paired_stats([0.80, 0.90, 0.70], [0.78, 0.86, float("nan")])
    # The NaN (a diverged run) drops its pair.
    assert st["pairs"] == 2 and st["off_mean"] == pytest.approx(0.85)
    assert st["diff_mean"] == pytest.approx(-0.03) and st["diff_std"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="equal lengths"):
        experiment.paired_stats([1.0], [1.0, 2.0])


def test_seed_groups_need_the_seed_the_name_says():
    cfg = config()
    cfg.variants = {"a_s1": {"seed": 1}, "a_s2": {"seed": 2}, "b_s3": {"seed": 0},
                    "c": {"seed": 4}}
    groups = experiment.seed_groups(experiment.variant_configs(cfg))
    # b_s3 runs seed 0, so its name's suffix is not a seed: a group of its own.
    assert groups == {"a": {1: "a_s1", 2: "a_s2"}, "b_s3": {0: "b_s3"}, "c": {4: "c"}}
    summaries = {"a_s1": {"final_accuracy": 0.5}, "a_s2": {"final_accuracy": 0.7},
                 "b_s3": {"final_accuracy": 0.1}, "c": {"final_accuracy": 0.2}}
    a, b, c = experiment.compare_groups(summaries, groups)
    assert (a["mean"], a["std"]) == (pytest.approx(0.6), pytest.approx(0.1))
    # No seed in common with the reference: no paired difference.
    assert b["pairs"] == 0 and np.isnan(b["diff_mean"])


def test_summary_uses_the_last_five_evaluations():
    rows = [{"round": r, "test_accuracy": r / 10, "test_loss": 1.0} for r in range(1, 9)]
    s = experiment.summarize(rows)
    assert s["final_accuracy"] == pytest.approx((0.4 + 0.5 + 0.6 + 0.7 + 0.8) / 5)
    assert s["best_accuracy"] == pytest.approx(0.8)


def test_local_test_accuracy_is_logged_when_asked(tmp_path):
    cfg = config(rounds=2, eval__local=True, partition__scheme="iid")
    experiment.train(cfg, str(tmp_path), progress=False)
    row = metrics(tmp_path)[-1]
    assert row["local_test_accuracy_min"] <= row["local_test_accuracy_mean"] <= 1.0
    # IID clients hold (nearly) the global label mix: their expected accuracy is the global one.
    assert abs(row["local_test_accuracy_mean"] - row["test_accuracy"]) < 0.03


def test_a_failing_overwrite_loses_nothing(tmp_path):
    workdir = str(tmp_path / "w")
    experiment.train(config(rounds=2), workdir, progress=False)
    before = {f: open(os.path.join(workdir, f), "rb").read()
              for f in ("config.json", "metrics.jsonl", "summary.json")}
    # Refused by the data (more clients than examples), then by a divergence in round 1.
    with pytest.raises(experiment.ConfigError, match="num_clients=5000 exceeds"):
        experiment.train(config(partition__num_clients=5000), workdir, overwrite=True,
                         progress=False)
    with pytest.raises(experiment.TrainingDiverged, match="round 1.*unchanged"):
        experiment.train(config(max_train_loss=0.01), workdir, overwrite=True, progress=False)
    assert os.listdir(tmp_path) == ["w"]
    assert {f: open(os.path.join(workdir, f), "rb").read() for f in before} == before
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
    # A new run that saved a round before failing is kept, and so are the old results.
    with pytest.raises(experiment.TrainingDiverged, match="round 2.*replacing are kept in "
                                                          r"(\S+)$") as info:
        experiment.train(config(optimizer__lr=100.0, optimizer__weight_decay=10.0), workdir,
                         overwrite=True, progress=False)
    aside = str(info.value).rsplit(" ", 1)[1]
    assert {f: open(os.path.join(aside, f), "rb").read() for f in before} == before
    assert len(metrics(workdir)) == 1


def test_a_loss_that_explodes_is_divergence_and_says_what_was_kept(tmp_path):
    # Finite but exploding (stopped before it turns NaN): still divergence.
    with pytest.raises(experiment.TrainingDiverged,
                       match=r"round 2: training loss \S+e\+\d+ exceeds config.max_train_loss"
                             r"=100; the last good checkpoint \(round 1\) is kept"):
        experiment.train(config(optimizer__lr=100.0, optimizer__weight_decay=10.0,
                                checkpoint_every=5), str(tmp_path / "a"),
                         progress=False)
    assert os.listdir(tmp_path / "a" / "checkpoints") == ["1"]
    with pytest.raises(experiment.TrainingDiverged,
                       match=r"round 1: .*no round completed, so nothing was kept"):
        experiment.train(config(max_train_loss=0.01), str(tmp_path / "c"), progress=False)
    assert not (tmp_path / "c").exists()  # so the same workdir can be used again at once
    # A limit the run stays under lets it finish.
    experiment.train(config(rounds=2, max_train_loss=50.0), str(tmp_path / "b"),
                     progress=False)


def test_resume_keeps_the_whole_runs_record(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    s_full = experiment.train(config(rounds=4), full, progress=False)
    s_2 = experiment.train(config(rounds=2), part, progress=False)
    with count_compiles() as second:
        s_4 = experiment.train(config(rounds=4), part, resume=True, progress=False)
    assert metrics(part) == metrics(full)
    # Summaries count every process: padding over all 4 rounds, compiles of both.
    assert s_4["processes"] == 2 and s_full["processes"] == 1
    assert s_4["padding_efficiency"] == pytest.approx(s_full["padding_efficiency"], abs=1e-12)
    assert s_4["padding_efficiency"] != s_2["padding_efficiency"]
    assert second.count > 0 and s_4["compiles"] == s_2["compiles"] + second.count
    assert s_4["compiles_after_first_round"] == 0
    assert s_4["wall_seconds"] > s_2["wall_seconds"]
    # Resuming a finished run changes nothing it wrote.
    summary = open(os.path.join(part, "summary.json")).read()
    config_json = open(os.path.join(part, "config.json")).read()
    assert experiment.train(config(rounds=4), part, resume=True, progress=False) == s_4
    assert open(os.path.join(part, "summary.json")).read() == summary
    assert open(os.path.join(part, "config.json")).read() == config_json
    # Fewer rounds than were run is refused before anything is written.
    with pytest.raises(experiment.ConfigError, match="rounds=3: it has run 4 rounds"):
        experiment.train(config(rounds=3), part, resume=True, progress=False)
    assert open(os.path.join(part, "config.json")).read() == config_json


def test_a_corrupt_checkpoint_is_reported_and_nothing_is_rewritten(tmp_path):
    workdir = str(tmp_path / "w")
    experiment.train(config(rounds=2), workdir, progress=False)
    config_json = open(os.path.join(workdir, "config.json")).read()
    data = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(workdir, "checkpoints", "2"))
            for f in fs if f"{os.sep}d{os.sep}" in os.path.join(d, f)]
    big = max(data, key=os.path.getsize)
    raw = bytearray(open(big, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(big, "wb").write(bytes(raw))
    with pytest.raises(experiment.WorkdirError, match="checkpoints/2 is corrupt.*resume from "
                                                      "round 1"):
        experiment.train(config(rounds=3), workdir, resume=True, progress=False)
    assert open(os.path.join(workdir, "config.json")).read() == config_json


def _full_disk_at(monkeypatch, rounds):
    """Checkpoint saves of `rounds` fail the way tensorstore reports a full disk."""
    import orbax.checkpoint as ocp
    real = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step in rounds:
            raise ValueError("RESOURCE_EXHAUSTED: Failed to write 2048 bytes to file 14: "
                             "No space left on device [os_error_code='28']")
        return real(self, step, *args, **kwargs)
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)


def test_a_full_disk_ends_in_one_line_and_the_run_resumes(tmp_path, monkeypatch):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    experiment.train(config(rounds=4, checkpoint_every=2), full, progress=False)
    _full_disk_at(monkeypatch, {4})
    with pytest.raises(experiment.WorkdirError,
                       match=r"cannot write the checkpoint of round 4: No space left on device; "
                             r".*holds rounds 1-2 .*resume"):
        experiment.train(config(rounds=4, checkpoint_every=2), part, progress=False)
    monkeypatch.undo()
    experiment.train(config(rounds=4, checkpoint_every=2), part, resume=True, progress=False)
    assert metrics(part) == metrics(full)


def test_a_full_disk_while_logging_metrics(tmp_path, monkeypatch):
    real_open = open

    def fake_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and mode == "a":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)
    monkeypatch.setattr(training, "open", fake_open, raising=False)
    with pytest.raises(experiment.WorkdirError,
                       match=r"metrics.jsonl: No space left on device.*no round of it was saved; "
                             r"free space; run the command again$"):
        experiment.train(config(rounds=2), str(tmp_path / "w"), progress=False)
    assert not (tmp_path / "w").exists()


def test_a_read_only_workdir_fails_before_the_data_loads(tmp_path, monkeypatch):
    from fedjax_pan import workdir as workdir_lib

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(workdir_lib.tempfile, "mkstemp", read_only)
    monkeypatch.setattr(assembly, "build", lambda *a, **k: pytest.fail("data was loaded"))
    with pytest.raises(experiment.WorkdirError, match="Read-only file system"):
        experiment.train(config(), str(tmp_path / "w"), progress=False)
    assert not (tmp_path / "w").exists()


def test_a_refused_workdir_costs_no_data_loading(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("keep me")
    monkeypatch.setattr(assembly, "build", lambda *a, **k: pytest.fail("data was loaded"))
    for preset in ("smoke", "compare"):
        with pytest.raises(experiment.ConfigError, match="not empty"):
            experiment.run(config(preset), str(tmp_path), progress=False)


# FedDyn's and MOON's per-client states are stored as Scaffold's is (params-shaped trees
# per client, stacked over all K), through the same checkpoint code.
# One of each kind of client state: params-shaped (Scaffold), flat partial dicts (FedPer),
# full variables (Ditto), a head (FedRoD), none but a personal model adapted on
# round-dependent batches (Per-FedAvg).
# The later personalised algorithms keep their states in each place in turn (a server
# holding every client's model, FedAMP's, included).
@pytest.mark.parametrize("algorithm,place", [
    ("scaffold", "auto"), *(pytest.param(a, p, marks=pytest.mark.slow) for a, p in (
        ("fedper", "auto"), ("ditto", "auto"), ("perfedavg", "auto"), ("fedrod", "auto"),
        ("fedamp", "disk"), ("fedphp", "host"), ("fedmtl", "device"),
        ("partialfed", "disk"), ("fedfomo", "host"), ("apple", "device"),
        ("fedproto", "disk"), ("fd", "host"), ("fedgh", "device"), ("fedpcl", "disk"),
        ("fedgc", "host"), ("fml", "disk"), ("fedkd", "host"), ("feddbe", "device"),
        ("fedcac", "disk"), ("fedas", "host"), ("fedcross", "device"), ("fedgen", "auto"),
        ("fedbabu", "auto"), ("fedntd", "auto"), ("fedlc", "auto"), ("fedcp", "auto"),
        ("gpfl", "auto"), ("fedpac", "disk"), ("fedda", "host")))])
def test_stateful_algorithms_resume_exactly(tmp_path, monkeypatch, algorithm, place):
    """Per-client state (control variates, previous models, gradients, personal models)
    goes through the checkpoint: 2 rounds + resume to 3 equals 3 rounds in one go, the
    clients' own-data metrics included. (A run of 3 stopped by Ctrl-C before its third
    round: FedPHP's moving-average schedule depends on the run's length.)"""
    import signal as signal_lib
    from conftest import signal_on_call
    from fedjax_pan.engine import Simulation
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    cfg = dict(algorithm=algorithm, rounds=3, checkpoint_every=2, local__epochs=2.0,
               partition__test_fraction=0.25, execution__client_states=place)
    summary = experiment.train(config(**cfg), full, progress=False)
    # The round the run drives: a Simulation, or a driver (FedCP's and GPFL's one group).
    owner = type(summary.experiment.simulation)
    assert owner is Simulation or algorithm in ("fedcp", "gpfl")
    signal_on_call(monkeypatch, owner, "round", signal_lib.SIGINT, 3)
    with pytest.raises(experiment.Interrupted):
        experiment.train(config(**cfg), part, progress=False)
    monkeypatch.undo()
    assert len(metrics(part)) == 2
    experiment.train(config(**cfg), part, resume=True, progress=False)
    assert metrics(part) == metrics(full) and len(metrics(full)) == 3
    assert all("pfl_accuracy" in m for m in metrics(full))


def test_augmentation_and_normalisation_settings_reach_the_engine():
    """crop_flip pads with black as normalised ('authors' constants on CIFAR-10: -mean/std
    per channel); 'none' leaves batches alone; an augmented run trains differently."""
    from fedjax_pan import data as data_lib
    cfg = config(dataset__augment="crop_flip")
    exp = experiment.build(cfg)
    assert exp.simulation.work.augment == assembly.Augment(4, True, (0.0,))  # unnormalised
    cifar = config(dataset__augment="crop_flip", dataset__normalization="authors")
    images, labels = np.zeros((2, 32, 32, 3), np.uint8), np.zeros(2, np.int32)
    fake = data_lib.Dataset("cifar10", images, labels, images, labels, num_classes=10)
    (mean, std) = data_lib.AUTHORS_NORMALIZATION["cifar10"]
    assert assembly._augment(cifar, fake).fill == tuple(-m / s for m, s in zip(mean, std))
    assert assembly._stats(cifar, fake)[1] == (0.2023, 0.1994, 0.2010)
    plain = experiment.build(config())
    assert plain.simulation.work.augment is None
    states = [e.simulation.round(e.simulation.init(e.variables))[0] for e in (exp, plain)]
    a, b = (s.server.params["fc1"]["kernel"] for s in states)
    assert float(abs(a - b).max()) > 1e-6  # far above float noise (round 1 warms up: lr/10)


def test_clients_are_scored_on_their_own_test_parts(tmp_path):
    """partition.test_fraction: disjoint local train/test parts; the logged per-client
    figures against a NumPy evaluation of the global model on each part; a personalised
    model (here the global one, handed out through personal_variables) scores the same."""
    cfg = config(rounds=2, partition__test_fraction=0.25, partition__scheme="pathological",
                 partition__classes_per_client=2, algorithm="scaffold")
    exp = experiment.build(cfg)
    train_parts, test_parts = exp.client_indices, exp.test_indices
    full = experiment.build(config(rounds=2, partition__scheme="pathological",
                                   partition__classes_per_client=2, algorithm="scaffold"))
    for tr, te, whole in zip(train_parts, test_parts, full.client_indices):
        assert len(np.intersect1d(tr, te)) == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), whole)
        assert len(te) == int(np.ceil(0.25 * len(whole) - 1e-9))
    np.testing.assert_array_equal(exp.simulation.data.sizes, [len(p) for p in train_parts])

    state, _ = experiment.train_rounds(exp, exp.simulation.init(exp.variables), 2,
                                       progress=False)
    net, variables = exp.simulation.evaluation(state.server)
    got = experiment.evaluate_clients(exp, state, net, variables)
    x, _ = assembly._normalized(cfg, exp.dataset, None)
    y = exp.dataset.train_labels
    acc = []
    for te in test_parts:
        logits = np.asarray(exp.model.apply(variables, x[te], train=False))
        acc.append((logits.argmax(1) == y[te]).sum() / len(te))
    sizes = np.array([len(te) for te in test_parts])
    assert abs(got["pfl_accuracy"] - np.sum(np.array(acc) * sizes) / sizes.sum()) < 1e-9
    assert abs(got["client_accuracy_mean"] - np.mean(acc)) < 1e-9
    assert abs(got["client_accuracy_std"] - np.std(acc)) < 1e-9
    algorithm = exp.simulation.algorithm
    exp.simulation.algorithm = algorithm._replace(
        personal_variables=lambda server, client_state: algorithm.eval_variables(server))
    for strategy in ("loop", "vmap"):
        exp.strategy = strategy
        assert experiment.evaluate_clients(exp, state, net, variables) == pytest.approx(got)

    experiment.train(cfg, str(tmp_path), progress=False)
    row = metrics(tmp_path)[-1]
    assert 0 <= row["client_accuracy_worst10"] <= row["client_accuracy_mean"] <= 1
    assert set(row) >= {"pfl_accuracy", "client_accuracy_std", "test_accuracy"}


def test_a_line_a_crash_cut_is_restored_from_the_checkpoint(tmp_path, monkeypatch):
    """metrics.jsonl is appended without fsync; a power cut can leave it shorter than the
    checkpoint it goes with. Resuming rebuilds it from the checkpoint's own record."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    whole = experiment.train(config(rounds=4), full, progress=False)
    experiment.train(config(rounds=3), part, progress=False)
    path = os.path.join(part, "metrics.jsonl")
    with open(path) as f:
        text = f.read()
    cut = text[:text.index("\n") + 1 + len(text.splitlines()[1]) // 2]  # row 2 cut in half
    with open(path, "w") as f:
        f.write(cut)
    summary = experiment.train(config(rounds=4), part, resume=True, progress=False)
    assert metrics(part) == metrics(full)
    assert summary["best_accuracy"] == whole["best_accuracy"]
    assert summary["final_accuracy"] == whole["final_accuracy"]
    # A checkpoint written before checkpoints held the rows: refuse, naming the line.
    with open(path, "w") as f:
        f.write(cut)
    restore = experiment.workdir_lib.Checkpoints.restore
    monkeypatch.setattr(experiment.workdir_lib.Checkpoints, "restore",
                        lambda self, *a, **k: (*restore(self, *a, **k)[:2], None))
    with pytest.raises(experiment.ConfigError, match=r"^line 2 of \S+metrics.jsonl is cut "
                                                     r"short .*--overwrite$"):
        experiment.train(config(rounds=5), part, resume=True, progress=False)
    with open(path) as f:
        assert f.read() == cut  # nothing was touched


def test_divergence_advice_names_the_options_set_away_from_their_default(tmp_path):
    with pytest.raises(experiment.TrainingDiverged,
                       match=r"check fedprox.mu=0.5 \(changed from the default\), or lower "
                             r"optimizer.lr"):
        experiment.train(config(rounds=1, max_train_loss=0.01, algorithm="fedprox",
                                fedprox__mu=0.5), str(tmp_path / "w"), progress=False)
    with pytest.raises(experiment.TrainingDiverged, match=r"nothing was kept; lower "
                                                          r"optimizer.lr or optimizer.grad_clip$"):
        experiment.train(config(rounds=1, max_train_loss=0.01), str(tmp_path / "w"),
                         progress=False)


@pytest.mark.parametrize("when", [
    "evaluating", *(pytest.param(w, marks=pytest.mark.slow) for w in (
        "between clients", "as the last round returns", "returning, without safe points"))])
def test_a_signal_after_a_round_ran_keeps_rows_and_checkpoints_consistent(tmp_path,
                                                                          monkeypatch, when):
    """FedPer keeps per-client state, whose buffers a round donates. Under
    `interrupts_at_safe_points` a SIGTERM while round 3 is evaluated waits for its files
    and is saved with it; one after round 3's second client (of 4) stops before the third,
    round 2's state intact; one as the last round returns waits for its files. A Ctrl-C
    raised at once as round 4 returns (no safe points: Python's own handler) finds round
    3's state, never checkpointed, already consumed, and leaves the checkpoint of round 2.
    The message names what is kept, rows and checkpoints agree, and --resume finishes the
    run as an uninterrupted one."""
    import signal

    from fedjax_pan import workdir
    from fedjax_pan.engine.execution import VmapExecutor
    from fedjax_pan.engine.simulation import Simulation
    sig, stopped, saved = signal.SIGTERM, "in round 4", 3
    if when == "evaluating":
        signal_on_call(monkeypatch, training, "evaluate_clients", sig, 3)
    elif when == "between clients":  # CPU, dense model: 4 vmapped blocks of 1 a round
        signal_on_call(monkeypatch, VmapExecutor, "_block_args", sig, 2 * 4 + 2)
        stopped, saved = "in round 3", 2
    elif when == "as the last round returns":
        signal_on_call(monkeypatch, Simulation, "round", sig, 4, after=True)
        stopped, saved = "after round 4", 4
    else:
        sig, stopped, saved = signal.SIGINT, "in round 4", 2
        signal_on_call(monkeypatch, Simulation, "round", sig, 4, after=True)
    w = str(tmp_path / "w")
    cfg = config(rounds=4, checkpoint_every=2, algorithm="fedper", partition__test_fraction=0.25)
    handling = (contextlib.nullcontext() if when.endswith("without safe points") else
                workdir.interrupts_at_safe_points())
    with handling, pytest.raises(experiment.Interrupted) as info:
        experiment.train(cfg, w, progress=False)
    assert info.value.status == 128 + sig
    assert str(info.value) == (f"interrupted {stopped}; rounds 1-{saved} are saved in {w}; "
                               f"continue with --resume")
    assert max(int(d) for d in os.listdir(os.path.join(w, "checkpoints"))) == saved
    monkeypatch.undo()
    experiment.train(cfg, w, resume=True, progress=False)
    straight = str(tmp_path / "straight")
    experiment.train(cfg, straight, progress=False)
    assert metrics(w) == metrics(straight)


def test_a_signal_after_the_last_safe_point_still_ends_the_command_with_its_status(
        tmp_path, monkeypatch, capsys):
    """A SIGTERM while the finished run's table is printed (no safe point after it) is
    raised as the command's signal handling ends: 143 and one line saying the results are
    complete, never 0; the handler is given back."""
    import signal

    from fedjax_pan.run import main
    w = str(tmp_path / "w")
    before = signal.getsignal(signal.SIGTERM)
    signal_on_call(monkeypatch, experiment, "format_table", signal.SIGTERM, 1)
    assert main.main(["prog", "--config=" + os.path.join(ROOT, "configs", "fmnist_mlp.py")
                      + ":smoke", "--noprogress", "--config.dataset.name=synthetic",
                      "--config.rounds=1", f"--workdir={w}"]) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"error: interrupted; the results in {w} are complete"]
    assert os.path.isfile(os.path.join(w, "summary.json"))


def test_noisy_clients_train_on_noisy_labels_and_everything_else_stays_clean():
    exp = assembly.build(config(partition__noisy_share=0.5, partition__noise_rate=1.0,
                                partition__test_fraction=0.2))
    clean = np.asarray(exp.dataset.train_labels)
    trained = np.asarray(exp.simulation.data.labels)
    noisy = data.noisy_clients(len(exp.client_indices), 0.5, exp.config.seed)
    for i, part in enumerate(exp.client_indices):
        changed = np.sum(trained[part] != clean[part])
        assert (changed > 0.5 * len(part)) if noisy[i] else changed == 0
    for part in exp.test_indices:  # the clients' own test parts keep their labels
        assert np.array_equal(trained[part], clean[part])
