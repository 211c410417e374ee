"""PAN paper Fig. 3 (VGG13), Fig. 14 (MLP) and Fig. 15 (ResNet20): shuffle error vs T and A.

For each architecture at its initialisation (the authors' init: kaiming-normal convs,
N(0, 0.01) linear weights), the hidden neurons of every layer are shuffled with Alg. 1
(P_sf = 1 by default: every neuron moves) and the shuffle error of Eq. 8,
||h_L,sf - h_L|| / J_L, is averaged over N(0, 1) random inputs in eval mode. Grids: PAN+
A in 0..0.25, PANx A in 0..0.75, T in {0, 1, 2, 4, 8}; left panels are heat maps over
(T, A) per kind, the right panel compares PAN+ and PANx at T = 1 on a shared A axis (bold:
the range the paper allows for each kind). The permutations and inputs are drawn once per
architecture, so every cell differs only in its PAN setting. A = 0 or T = 0 is the plain
network, whose shuffle error must vanish up to floating point.

Reported honestly: at this init on N(0, 1) inputs PAN+ can give a larger absolute error
than PANx on MLP/VGG13, while PANx grows faster (superlinearly) in A; `growth` is
err(A_max) / err(A_min) at T = 1 against the linear expectation A_max / A_min.

ResNet20 is shuffled block by block, its identity shortcuts written as explicit identity
1x1 convs (the authors' way; `models.explicit_shortcuts`); drop the option from its
`ModelSpec` to shuffle one residual stream per stage instead.

Presets: paper (full models, 64 inputs, 3 permutation draws, finer grids), default (full
models, 16 inputs, 1 draw), smoke (reduced widths, 4 inputs, 2x2 grids).
Outputs: shuffle_error.csv, shuffle_error.json, shuffle_error_<model>.png.
"""

from __future__ import annotations

import dataclasses
import sys
from types import MappingProxyType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from matplotlib.figure import Figure

from experiments import common
from fedjax_pan import models
from fedjax_pan.pan import permutation

KINDS = ("add", "mul")
KIND_LABEL = {"add": "PAN+", "mul": "PANx"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    input_shape: Tuple[int, int, int]
    options: Tuple[Tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Settings:
    models: Tuple[ModelSpec, ...] = (ModelSpec("mlp", (28, 28, 1)),
                                     ModelSpec("vgg13", (32, 32, 3)),
                                     ModelSpec("resnet20", (32, 32, 3),
                                               (("explicit_shortcuts", True),)))
    add_amplitudes: Tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25)
    mul_amplitudes: Tuple[float, ...] = (0.0, 0.15, 0.3, 0.45, 0.6, 0.75)
    periods: Tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0)
    line_period: float = 1.0
    p_sf: float = 1.0
    num_inputs: int = 16
    draws: int = 1  # permutation draws averaged per cell


_FINE_ADD = tuple(round(0.025 * i, 4) for i in range(11))
_FINE_MUL = tuple(round(0.075 * i, 4) for i in range(11))
PRESETS = MappingProxyType({
    "paper": Settings(add_amplitudes=_FINE_ADD, mul_amplitudes=_FINE_MUL,
                      periods=(0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0), num_inputs=64, draws=3),
    "default": Settings(),
    "smoke": Settings(models=(ModelSpec("mlp", (28, 28, 1), (("hidden", (32, 32, 32)),)),
                              ModelSpec("vgg13", (16, 16, 3), (("width", 0.125),)),
                              ModelSpec("resnet20", (16, 16, 3),
                                        (("widths", (8, 16, 32)), ("stem_width", 8),
                                         ("blocks_per_stage", 2),
                                         ("explicit_shortcuts", True)))),
                      add_amplitudes=(0.0, 0.25), mul_amplitudes=(0.0, 0.75),
                      periods=(0.0, 1.0), num_inputs=4),
})


class ErrorGrid:
    """Shuffle errors of one architecture, cached by effective PAN setting."""

    def __init__(self, spec: ModelSpec, s: Settings, seed: int):
        self.spec = spec
        self.options = dict(spec.options)
        plain = models.build(spec.name, 10, **self.options)
        key_init, key_x = jax.random.split(jax.random.PRNGKey(seed))
        # Encodings are constants, not variables: one set of weights serves every PAN setting.
        self.variables = models.init(plain, key_init, spec.input_shape)
        self.perm_spec = permutation.spec_for(plain, self.variables)
        rng = np.random.default_rng(seed)
        self.perms = [permutation.random_permutations(self.perm_spec, rng, s.p_sf)
                      for _ in range(s.draws)]
        self.x = jax.random.normal(key_x, (s.num_inputs, *spec.input_shape))
        out = np.asarray(plain.apply(self.variables, self.x, train=False), np.float64)
        # Eq. 8's scale of the output itself, to express errors relative to it.
        self.output_scale = float(np.mean(np.linalg.norm(out, axis=-1)) / out.shape[-1])
        self._cache: Dict[Any, float] = {}

    def error(self, pan: common.Pan) -> float:
        key = (pan.kind, pan.period, pan.amplitude) if pan.on else "off"
        if key not in self._cache:
            model = models.build(self.spec.name, 10, pan=pan.as_dict(), **self.options)
            self._cache[key] = float(np.mean([
                permutation.shuffle_error(model, self.variables, perms, self.perm_spec, self.x)
                for perms in self.perms]))
        return self._cache[key]


def _amplitudes(s: Settings, kind: str) -> Tuple[float, ...]:
    return s.add_amplitudes if kind == "add" else s.mul_amplitudes


def _line_amplitudes(s: Settings) -> Tuple[float, ...]:
    return tuple(sorted(set(s.add_amplitudes) | set(s.mul_amplitudes)))


def _plot(spec: ModelSpec, s: Settings, heat: Dict[str, np.ndarray],
          lines: Dict[str, np.ndarray]) -> Figure:
    fig = Figure(figsize=(14.0, 3.9))
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.0, 1.0, 1.1]})
    for ax, kind in zip(axes[:2], KINDS):
        amps = _amplitudes(s, kind)
        grid = heat[kind]
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(amps)))
        ax.set_xticklabels([f"{a:g}" for a in amps], rotation=45 if len(amps) > 6 else 0)
        ax.set_yticks(range(len(s.periods)))
        ax.set_yticklabels([f"{t:g}" for t in s.periods])
        ax.set(xlabel="A", ylabel="T", title=f"{spec.name}: {KIND_LABEL[kind]} shuffle error")
        if grid.size <= 49:
            top = grid.max()
            for (i, j), v in np.ndenumerate(grid):
                # The plain network's floating-point residue would only clutter the map.
                text = f"{v:.2g}" if v > 1e-6 * top else "0"
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="black" if v > 0.6 * top else "white")
        fig.colorbar(image, ax=ax, shrink=0.85)
    ax = axes[2]
    amps = np.array(_line_amplitudes(s))
    for kind, color in zip(KINDS, ("tab:blue", "tab:red")):
        allowed = amps <= max(_amplitudes(s, kind)) + 1e-12
        ax.plot(amps, lines[kind], color=color, lw=1, ls="--")
        ax.plot(amps[allowed], lines[kind][allowed], color=color, lw=3, marker="o", ms=4,
                label=f"{KIND_LABEL[kind]} (bold: A <= {max(_amplitudes(s, kind)):g})")
    ax.set(xlabel="A", ylabel="shuffle error",
           title=f"{spec.name}: PAN+ vs PANx at T={s.line_period:g}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _growth(amps: Sequence[float], errors: Sequence[float]) -> Dict[str, float]:
    """err(A_max) / err(A_min) over the positive amplitudes, and the linear expectation."""
    pos = [(a, e) for a, e in zip(amps, errors) if a > 0]
    if len(pos) < 2:
        return {"growth": float("nan"), "linear_growth": float("nan")}
    (a0, e0), (a1, e1) = pos[0], pos[-1]
    return {"a_min": a0, "a_max": a1, "growth": e1 / e0 if e0 > 0 else float("nan"),
            "linear_growth": a1 / a0}


def run(s: Settings, ctx: common.Context) -> List[str]:
    rows, summary, lines_out = [], {}, []
    for spec in s.models:
        grid = ErrorGrid(spec, s, ctx.seed)
        line_amps = _line_amplitudes(s)
        jobs = ([(k, t, a) for k in KINDS for t in s.periods for a in _amplitudes(s, k)] +
                [(k, s.line_period, a) for k in KINDS for a in line_amps])
        for kind, t, a in common.progress(jobs, ctx.progress, f"{spec.name} shuffle error"):
            grid.error(common.Pan(kind, t, a))
        heat = {k: np.array([[grid.error(common.Pan(k, t, a)) for a in _amplitudes(s, k)]
                             for t in s.periods]) for k in KINDS}
        lines = {k: np.array([grid.error(common.Pan(k, s.line_period, a)) for a in line_amps])
                 for k in KINDS}
        for k in KINDS:
            for i, t in enumerate(s.periods):
                for j, a in enumerate(_amplitudes(s, k)):
                    rows.append({"model": spec.name, "kind": k, "period": t, "amplitude": a,
                                 "shuffle_error": heat[k][i, j],
                                 "relative_error": heat[k][i, j] / grid.output_scale})
        off = grid.error(common.PANS_OFF)
        per_kind = {}
        for k in KINDS:
            t_row = [grid.error(common.Pan(k, s.line_period, a)) for a in _amplitudes(s, k)]
            per_kind[k] = {"amplitudes": _amplitudes(s, k), "periods": s.periods,
                           "heatmap": heat[k], "line_T": s.line_period, "line": t_row,
                           **_growth(_amplitudes(s, k), t_row),
                           "max_error": float(heat[k].max())}
        summary[spec.name] = {
            "options": dict(spec.options), "input_shape": spec.input_shape,
            "output_scale": grid.output_scale, "error_at_A0": off,
            "relative_error_at_A0": off / grid.output_scale,
            "shared_line": {"amplitudes": line_amps, "add": lines["add"], "mul": lines["mul"]},
            **per_kind}
        common.save_figure(_plot(spec, s, heat, lines), ctx.path(f"shuffle_error_{spec.name}.png"))
        add, mul = per_kind["add"], per_kind["mul"]
        lines_out.append(
            f"  {spec.name:<9} A=0: {off:.2e} (rel {off / grid.output_scale:.1e})  "
            f"T={s.line_period:g}: PAN+ A={add['a_max']:g}: {add['line'][-1]:.3g} "
            f"(growth x{add['growth']:.2f} vs linear x{add['linear_growth']:.1f})  "
            f"PANx A={mul['a_max']:g}: {mul['line'][-1]:.3g} "
            f"(growth x{mul['growth']:.2f} vs linear x{mul['linear_growth']:.1f})"
            if "a_max" in add and "a_max" in mul else
            f"  {spec.name:<9} A=0: {off:.2e} (rel {off / grid.output_scale:.1e})")
    common.write_csv(ctx.path("shuffle_error.csv"), rows)
    common.write_json(ctx.path("shuffle_error.json"),
                      {"p_sf": s.p_sf, "num_inputs": s.num_inputs, "draws": s.draws,
                       "models": summary})
    return [f"shuffle error (Eq. 8), P_sf={s.p_sf:g}, {s.num_inputs} N(0,1) inputs:"] + lines_out


def main(argv: Optional[Sequence[str]] = None) -> int:
    return common.run_script("shuffle_error", __doc__, PRESETS, run, argv)


if __name__ == "__main__":
    sys.exit(main())
