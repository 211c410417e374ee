"""PAN paper Fig. 6 (and Fig. 16): weight divergence of local models with PANs off vs on.

FedAvg with the MLP (K = 10 clients, R = 1.0, Dirichlet alpha in {1.0, 0.1} over clients,
B = 64, SGD lr 0.05 momentum 0.9) for H rounds, PANs off vs on (PANx, T = 1, A = 0.1).
After the last round every client trains E epochs from the global model alone
(`Simulation.client_updates`), and per layer (fc1, fc2, fc3, head; kernel and bias
together) the divergence (1/|S|) sum_k ||W_k - W_avg||_2 of the local models around their
mean is computed (App. E); Fig. 6 shows it as bars per layer, PANs off (blue) vs on (red).

The paper runs Mnist with H = 20 and E in {5, 20}; here the data are Fashion-MNIST.
Presets: paper (full data, H = 20, E in {5, 20}), default (a 20,000-example subset, H = 5,
E = 2; a few minutes on 2 CPU cores), smoke (synthetic data, 32-wide MLP, K = 4, H = 2).
Outputs: weight_divergence.csv, weight_divergence.json, fig6_divergence_E<E>_alpha<a>.png.
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import List, Optional, Sequence, Tuple

from experiments import common
from experiments.common import FLSetup, Pan
from fedjax_pan.analysis import plot_divergence, weight_divergence


@dataclasses.dataclass(frozen=True)
class Settings:
    setup: FLSetup = FLSetup(train_limit=20_000, rounds=5)
    alphas: Tuple[float, ...] = (1.0, 0.1)
    epochs: Tuple[float, ...] = (2.0,)
    pan_on: Pan = common.PANS_ON


PRESETS = MappingProxyType({
    "paper": Settings(setup=FLSetup(rounds=20), epochs=(5.0, 20.0)),
    "default": Settings(),
    "smoke": Settings(setup=FLSetup(dataset="synthetic", hidden=(32, 32, 32), num_clients=4,
                                    rounds=2, warmup="none", strategy="loop"),
                      alphas=(1.0,), epochs=(1.0,)),
})


def run(s: Settings, ctx: common.Context) -> List[str]:
    rows, results = [], []
    lines = ["weight divergence (sum over layers) after the last round, PANs off vs on:"]
    for epochs in s.epochs:
        for alpha in s.alphas:
            setup = dataclasses.replace(s.setup, alpha=alpha, epochs=epochs)
            div, acc = {}, {}
            for name, pan in (("off", common.PANS_OFF), ("on", s.pan_on)):
                cfg = common.fl_config(setup, pan, ctx.seed)
                exp, state, info = common.train_fl(
                    cfg, ctx.progress, f"E={epochs:g} alpha={alpha:g} PANs {name}")
                local = common.local_variables(exp, state)
                div[name] = weight_divergence([v["params"] for v in local])
                acc[name] = info["test_accuracy"]
                for layer, value in div[name].items():
                    rows.append({"epochs": epochs, "alpha": alpha, "pans": name,
                                 "pan": pan.label, "layer": layer, "divergence": value})
            totals = {k: sum(v.values()) for k, v in div.items()}
            results.append({"epochs": epochs, "alpha": alpha, "rounds": setup.rounds,
                            "divergence": div, "total": totals,
                            "total_ratio_on_off": totals["on"] / totals["off"],
                            "test_accuracy": acc})
            plot_divergence(div["off"], div["on"],
                            path=ctx.path(f"fig6_divergence_E{epochs:g}_alpha{alpha:g}.png"),
                            title=f"weight divergence (MLP, alpha={alpha:g}, E={epochs:g}, "
                                  f"H={setup.rounds})")
            per_layer = ", ".join(f"{k} {div['off'][k]:.3g}/{div['on'][k]:.3g}"
                                  for k in div["off"])
            lines.append(f"  E={epochs:g} alpha={alpha:g}: total off {totals['off']:.4g}, "
                         f"on {totals['on']:.4g} (on/off {totals['on'] / totals['off']:.2f}); "
                         f"per layer off/on: {per_layer}; test acc off "
                         f"{100 * acc['off']:.2f}%, on {100 * acc['on']:.2f}%")
    common.write_csv(ctx.path("weight_divergence.csv"), rows)
    common.write_json(ctx.path("weight_divergence.json"),
                      {"setup": s.setup, "pan_on": s.pan_on, "results": results})
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("weight_divergence", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
