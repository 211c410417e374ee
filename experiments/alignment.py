"""PAN paper Figs. 7-8 (and 19, 22-23 for the MLP): are neurons at the same coordinates of
the global and a local model aligned, PANs off vs on?

A global MLP is trained with FedAvg on Fashion-MNIST (K = 10, R = 1.0, Dirichlet alpha = 1.0,
B = 64, SGD lr 0.05 momentum 0.9) for H rounds; then one randomly sampled client trains E
epochs from the global model (App. E), giving its local model. Two analyses (Sect. 5.2):

(a) Matching via optimal assignment (Fig. 7): every neuron of a layer is represented by its
    activations on 500 test samples; the Hungarian method matches global to local neurons
    minimising the summed Euclidean distances; the share of matches on the diagonal says
    how many neurons kept their coordinates (a random matching gives 1/J).
(b) Preference vectors (Fig. 8): p[i, c] = sum_b Acti(x_c,b) dZ_c/dActi(x_c,b) over the
    class-c test samples; the fraction of neurons whose preferred class (argmax_c) agrees
    between global and local model.

Layers: fc2 and fc3 (the MLP's `features` is fc3's output, so it is not repeated) and, for
the preference vectors, the head (FC4, Fig. 22: its logits, whose preferences are diagonal
by construction, dZ_c/dZ_i = [i = c]). A neuron is represented by its
post-PAN, pre-ReLU outputs, as the authors' code does (`pre_relu=False`: post-ReLU
activations, whose silent neurons are interchangeable; `dead_neurons` counts them).
The paper uses Mnist, H = 20, E = 20. Presets: paper (full data, H = 20, E = 20, all test
samples for preferences), cpu (the paper's lengths on a 10,000-example subset; about 20
minutes a seed on 2 CPU cores), default (a 20,000-example subset, H = 5 rounds of E = 2,
then 10 local epochs for the analysed client), smoke (synthetic data, small MLP, K = 4).
Every analysis runs with seeds 0, 1, 2 (smoke: 0, 1); PANs off and on of a seed share the
partition, cohorts, initial weights and the analysed client, and the effect is reported as
the paired difference on - off with its spread. The FL runs train into runs/s<seed>_<off|on>/
with a checkpoint every round: --resume keeps finished seeds and continues an interrupted
run from its last round.
Outputs: alignment.json, alignment.csv (per seed), alignment_summary.csv (mean / std off
and on, paired difference), fig7_assignment_<layer>_<off|on>.png,
fig8_preferences_<layer>_<off|on>.png (first seed; the first `show_neurons` neurons;
agreement in the JSON counts all of them).
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from experiments import common
from experiments.common import FLSetup, Pan
from fedjax_pan.run import experiment
from fedjax_pan.analysis import (class_agreement, diagonal_ratio, neuron_classes,
                                 neuron_representations, optimal_assignment, plot_assignment,
                                 plot_preferences, preference_vectors)


@dataclasses.dataclass(frozen=True)
class Settings:
    setup: FLSetup = FLSetup(train_limit=20_000, alpha=1.0, epochs=2.0, rounds=5)
    local_epochs: Optional[float] = 10.0  # the analysed client's E (None: setup.epochs)
    pan_on: Pan = common.PANS_ON
    num_samples: int = 500  # test samples representing a neuron (paper: 500)
    preference_samples: int = 2000  # test samples for the preference vectors
    assignment_layers: Tuple[str, ...] = ("fc2", "fc3")
    pre_relu: bool = True  # the authors' neuron representation
    preference_layers: Tuple[str, ...] = ("fc2", "fc3", "head")
    show_neurons: int = 64
    seeds: Tuple[int, ...] = (0, 1, 2)  # figures show the first


_PAPER = Settings(setup=FLSetup(alpha=1.0, epochs=20.0, rounds=20), local_epochs=None,
                  preference_samples=10_000)
PRESETS = MappingProxyType({
    "paper": _PAPER,
    # The paper's lengths (H = 20 rounds of E = 20, then E = 20 on the analysed client) on
    # a 10,000-example subset: the full set takes about 2.7 h a seed on 2 cores.
    "cpu": dataclasses.replace(_PAPER, setup=dataclasses.replace(_PAPER.setup,
                                                                 train_limit=10_000)),
    "default": Settings(),
    "smoke": Settings(setup=FLSetup(dataset="synthetic", hidden=(64, 64, 64), num_clients=4,
                                    alpha=1.0, epochs=1.0, rounds=2, warmup="none",
                                    strategy="loop"),
                      local_epochs=2.0, num_samples=100, preference_samples=200,
                      show_neurons=16, seeds=(0, 1)),
})


def analysed_client(cfg: Any, state: Any, local_epochs: Optional[float]
                    ) -> Tuple[int, Any]:
    """(client id, local variables) of one client sampled in round `state.round`, trained
    alone from the global model for `local_epochs` (an experiment sampling 1 of K clients)."""
    one = cfg.copy_and_resolve_references()
    one.participation = 1.0 / cfg.partition.num_clients
    if local_epochs is not None:
        one.local.epochs = float(local_epochs)
    exp = experiment.build(one)
    client = int(exp.simulation.sample(state.round)[0])
    return client, common.local_variables(exp, state)[0]


def one_seed(s: Settings, ctx: common.Context, seed: int) -> Dict[str, Any]:
    """PANs off and on from one seed: {"results": {side: analyses}, "rows": csv rows}; the
    figures are drawn for the first seed."""
    results, rows = {}, []
    draw = seed == s.seeds[0]
    for name, pan in (("off", common.PANS_OFF), ("on", s.pan_on)):
        cfg = common.fl_config(s.setup, pan, seed)
        exp, state, info = common.train_fl_run(cfg, ctx.path(f"runs/s{seed}_{name}"), ctx,
                                               f"s{seed} PANs {name}")
        glob = common.global_variables(exp, state)
        client, local = analysed_client(cfg, state, s.local_epochs)
        x, _ = common.sample_test_inputs(exp, s.num_samples, seed)
        px, py = common.sample_test_inputs(exp, s.preference_samples, seed + 1)
        res = {"pan": pan, "client": client, "test_accuracy": info["test_accuracy"],
               "train_loss": info["train_loss"], "diagonal_ratio": {}, "class_agreement": {},
               "layer_width": {}, "dead_neurons": {}, "diagonal_ratio_live": {},
               "class_agreement_live": {}}
        for layer in s.assignment_layers:
            reps_g = neuron_representations(exp.model, glob, x, layer, pre_relu=s.pre_relu)
            reps_l = neuron_representations(exp.model, local, x, layer, pre_relu=s.pre_relu)
            perm = optimal_assignment(reps_g, reps_l)
            ratio = diagonal_ratio(perm)
            # Neurons silent on every sample in both models are interchangeable for the
            # matching (zero distance among them): also report the live neurons alone.
            live = (np.abs(reps_g).max(axis=1) > 0) | (np.abs(reps_l).max(axis=1) > 0)
            res["diagonal_ratio"][layer] = ratio
            res["diagonal_ratio_live"][layer] = float(np.mean(
                perm[live] == np.arange(len(perm))[live])) if live.any() else float("nan")
            res["dead_neurons"][layer] = int(np.sum(~live))
            res["layer_width"][layer] = len(perm)
            if draw:
                plot_assignment(perm, title=f"{layer}, PANs {name} (seed {seed})",
                                path=ctx.path(f"fig7_assignment_{layer}_{name}.png"))
            rows.append({"seed": seed, "pans": name, "analysis": "diagonal_ratio",
                         "layer": layer,
                         "value": ratio, "neurons": len(perm)})
        num_classes = exp.dataset.num_classes
        for layer in s.preference_layers:
            pg = preference_vectors(exp.model, glob, px, py, layer, num_classes)
            pl = preference_vectors(exp.model, local, px, py, layer, num_classes)
            agree = class_agreement(pg, pl)
            res["class_agreement"][layer] = agree
            # An all-zero preference row (a dead neuron) has argmax 0 in both models and
            # would count as agreement: also report the neurons alive in either model.
            live = (np.abs(pg).max(axis=1) > 0) | (np.abs(pl).max(axis=1) > 0)
            res["class_agreement_live"][layer] = float(np.mean(
                neuron_classes(pg)[live] == neuron_classes(pl)[live])) \
                if live.any() else float("nan")
            n = min(s.show_neurons, len(pg))
            if draw:
                plot_preferences(pg[:n], pl[:n],
                                 title=f"{layer}, PANs {name} (first {n} neurons, seed {seed})",
                                 path=ctx.path(f"fig8_preferences_{layer}_{name}.png"))
            rows.append({"seed": seed, "pans": name, "analysis": "class_agreement",
                         "layer": layer,
                         "value": agree, "neurons": len(pg)})
        results[name] = res
    return {"results": results, "rows": rows}


def summarize(per_seed: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Per analysis and layer: off / on over seeds and the paired difference on - off."""
    first = per_seed[0]["results"]["off"]
    out = []
    for analysis in ("diagonal_ratio", "diagonal_ratio_live", "class_agreement",
                     "class_agreement_live"):
        for layer in first[analysis]:
            off, on = ([r["results"][side][analysis][layer] for r in per_seed]
                       for side in ("off", "on"))
            out.append({"analysis": analysis, "layer": layer,
                        **experiment.paired_stats(off, on), "seeds": len(per_seed)})
    off, on = ([r["results"][side]["test_accuracy"] for r in per_seed] for side in ("off", "on"))
    out.append({"analysis": "test_accuracy", "layer": "global",
                **experiment.paired_stats(off, on), "seeds": len(per_seed)})
    return out


@common.resumable
def run(s: Settings, ctx: common.Context) -> List[str]:
    per_seed = [common.seed_result(ctx, seed, s, lambda seed=seed: one_seed(s, ctx, seed))
                for seed in s.seeds]
    table = summarize(per_seed)
    common.write_csv(ctx.path("alignment.csv"), [row for r in per_seed for row in r["rows"]])
    common.write_csv(ctx.path("alignment_summary.csv"), table)
    common.write_json(ctx.path("alignment.json"), {
        "setup": s.setup, "local_epochs": s.local_epochs if s.local_epochs is not None
        else s.setup.epochs, "num_samples": s.num_samples,
        "representation": "post-PAN pre-ReLU" if s.pre_relu else "post-ReLU",
        "preference_samples": s.preference_samples, "seeds": s.seeds,
        "per_seed": [r["results"] for r in per_seed], "results": per_seed[0]["results"],
        "summary": table})
    width = per_seed[0]["results"]["off"]["layer_width"]
    lines = [f"alignment of global vs local model (alpha={s.setup.alpha:g}, "
             f"H={s.setup.rounds}, local E={s.local_epochs or s.setup.epochs:g}), mean +- std "
             f"over seeds {list(s.seeds)}, off -> on, on - off paired by seed:"]
    for r in table:
        scale = 100 if r["analysis"] == "test_accuracy" else 1
        chance = (f" (random matching {1 / width[r['layer']]:.4f})"
                  if r["analysis"] == "diagonal_ratio" else "")
        lines.append(f"  {r['analysis']:<20} {r['layer']:<6} {scale * r['off_mean']:.3f} +- "
                     f"{scale * r['off_std']:.3f} -> {scale * r['on_mean']:.3f} +- "
                     f"{scale * r['on_std']:.3f}; on - off {scale * r['diff_mean']:+.3f} +- "
                     f"{scale * r['diff_std']:.3f}{chance}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("alignment", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
