"""The aggregation rules a config names (`config.aggregation.rule`), one `RuleEntry` each.

An entry says how to build its rule from `config.aggregation`, the keys it reads there
(`options`, with their defaults) and their `rules`, its cross-checks, whether it scores
models on the server's labelled public set, its reference and a one-line summary. The
default config (`config_options`), the schema (`config_rules`), the public-set size, the
fidelity catalogue and the benchmarks read `RULES`: a new rule is one entry here, its
implementation beside this file and its test.

    coordinate.py   median, trimmed_mean (Yin et al. 2018), over outputs
    robust.py       multi_krum, geometric_median (RFA) over outputs; zeno over models;
                    public_scorer, the public-set scorer of zeno and sageflow
    staleness.py    fedasync, sageflow, over models weighed by their staleness
    learned.py      auto_weights (FAIR), over models mixed with weights learned on the
                    public set
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

from ml_collections.config_dict import FieldReference, placeholder

from fedjax_pan.algorithms.aggregation import coordinate, learned, robust, staleness
from fedjax_pan.algorithms.aggregation.coordinate import median, trimmed_mean
from fedjax_pan.algorithms.aggregation.learned import auto_weights, learn_weights
from fedjax_pan.algorithms.aggregation.robust import (geometric_median, krum_kept,
                                                       krum_scores, multi_krum,
                                                       pairwise_sq_distances, public_scorer,
                                                       zeno, zeno_kept)
from fedjax_pan.algorithms.aggregation.staleness import (FEDASYNC_KINDS, fedasync, sageflow,
                                                          staleness_weight)
from fedjax_pan.engine.protocol import Aggregator, PyTree, weighted_mean
from fedjax_pan.engine.simulation import clients_per_round
from fedjax_pan.references import SAGEFLOW, Reference
from fedjax_pan.rules import Rule, between, boolean, one_of

PUBLIC_SIZE = 1000  # a public rule's held-out set by default: SageFlow's (num_commondata)


class RuleContext(NamedTuple):
    """What a rule's `build` reads besides `config.aggregation`: `score(variables)` ->
    {'loss', 'entropy', 'accuracy'} of a model on the server's labelled public set
    (`robust.public_scorer`; None unless the entry is `public`), and `late`: clients can
    answer late (`straggler.max_delay > 0`)."""

    score: Optional[Callable[[PyTree], Dict[str, Any]]] = None
    late: bool = False


class RuleEntry(NamedTuple):
    """How a config names and builds an aggregation rule.

    `build(options, context)` -> the `engine.protocol.Aggregator`, `options` being
    `config.aggregation` and `context` a `RuleContext`. `options`: the defaults of the
    keys under `config.aggregation` the rule reads (nested dicts for nested keys); `rules`:
    a `fedjax_pan.rules.Rule` per key, dotted and relative to `config.aggregation`. A key
    two rules read is declared by both with equal defaults and the same Rule object (e.g.
    `BYZANTINE`). `check(cfg)` raises ValueError (its text after 'config.') for settings
    of the whole config the rule cannot run with (a rule that does not read
    `aggregation.byzantine` refuses a value but 0). `public`: it scores models on the
    server's labelled public set (`dataset.public_size`, `PUBLIC_SIZE` where 0).
    """

    build: Callable[[Any, RuleContext], Aggregator]
    options: Dict[str, Any]
    rules: Dict[str, Rule]
    check: Optional[Callable[[Any], None]] = None
    public: bool = False
    reference: Optional[Reference] = None
    summary: str = ""


# Shared by the rules that read the key (Multi-Krum's f, Zeno's b); each checks it
# against the clients a round, and every other rule refuses a value but 0 (`_unread`).
_BYZANTINE = between(0, 1e5, integer=True)


def _byzantine(value: Any) -> Optional[str]:
    want = _BYZANTINE.check(value)
    return want and (f"{want}: under multi_krum at most the clients a round - 3, under "
                     f"zeno at most the clients a round - 1, under the other rules 0")


BYZANTINE = dataclasses.replace(_BYZANTINE, check=_byzantine)


def _per_round(cfg: Any) -> int:
    return clients_per_round(cfg.participation, cfg.partition.num_clients)


def _krum_check(cfg: Any) -> None:
    agg = cfg.aggregation
    m = _per_round(cfg)
    try:
        krum_kept(m, agg.byzantine, agg.krum_keep)
    except ValueError as e:
        valid = (f"aggregation.byzantine in [0, {m - 3}], aggregation.krum_keep in "
                 f"[1, {m}] or unset" if m >= 3 else "Multi-Krum needs at least 3 clients a "
                 "round: raise participation or partition.num_clients")
        raise ValueError(f"aggregation.rule='multi_krum' with aggregation.byzantine = "
                         f"{agg.byzantine} and aggregation.krum_keep = {agg.krum_keep} "
                         f"({m} clients a round): {e} ({valid})") from None


def _zeno_check(cfg: Any) -> None:
    agg = cfg.aggregation
    m = _per_round(cfg)
    try:
        zeno_kept(m, agg.byzantine)
    except ValueError as e:
        raise ValueError(f"aggregation.byzantine={agg.byzantine} with aggregation.rule="
                         f"'zeno' ({m} clients a round): {e}; set aggregation.byzantine in "
                         f"[0, {m - 1}]") from None


def _unread(own: str = "") -> Callable[[Any], None]:
    """The check of a rule that does not read `aggregation.byzantine`: a value but 0
    would claim a tolerance the rule does not have. `own`: what the rule tolerates by."""
    def check(cfg: Any) -> None:
        agg = cfg.aggregation
        b = agg.get("byzantine", 0)
        if b:
            readers = [name for name, entry in RULES.items() if "byzantine" in entry.options]
            raise ValueError(f"aggregation.byzantine={b} is not used by aggregation.rule="
                             f"{agg.rule!r}{own}; set aggregation.byzantine=0, or a rule "
                             f"that reads it ({', '.join(readers)})")
    return check


def _sageflow(options: Any, context: RuleContext) -> Aggregator:
    o = options.sageflow
    return sageflow(o.entropy_threshold, o.delta, o.lam, o.gamma_period if context.late else 0,
                    context.score, o.get("min_weight", 1e-3))


def _fedasync(options: Any, context: RuleContext) -> Aggregator:
    o = options.fedasync
    return fedasync(o.mixing, o.staleness, o.a, o.b)


def _auto_weights(options: Any, context: RuleContext) -> Aggregator:
    o = options.auto_weights
    return auto_weights(o.steps, o.lr, context.score, o.apply)


RULES: Dict[str, RuleEntry] = {
    "mean": RuleEntry(
        lambda options, context: weighted_mean, {}, {}, check=_unread(),
        reference=Reference(
            "McMahan et al., AISTATS 2017 (FedAvg, Alg. 1: w <- sum_k n_k / n w_k)", None,
            ("the default `aggregation.weights='uniform'` counts each client 1, as the PAN "
             "authors' code (SPEC 3); 'num_examples' is the paper's n_k / n",)),
        summary="the outputs' mean, weighted by `aggregation.weights` (streamed: no "
                "client's output is kept)"),
    "median": RuleEntry(
        lambda options, context: median(), {}, {}, check=_unread(),
        reference=Reference("Yin et al., ICML 2018 (coordinate-wise median, Alg. 1 option I)",
                            None, ()),
        summary="the coordinate-wise median of the outputs"),
    "trimmed_mean": RuleEntry(
        lambda options, context: trimmed_mean(options.trim),
        {"trim": 0.1}, {"trim": between(0, 0.5, hi_open=True)},
        check=_unread(": its tolerance is aggregation.trim, the share cut at each end"),
        reference=Reference(
            "Yin et al., ICML 2018 (coordinate-wise beta-trimmed mean, Alg. 1 option II)",
            None,
            ("floor(trim n) values cut at each end of the n present (the paper's beta n, "
             "rounded down where beta n is not whole)",)),
        summary="the coordinate-wise mean after cutting `trim` of the clients at each end"),
    "multi_krum": RuleEntry(
        lambda options, context: multi_krum(options.byzantine, options.krum_keep),
        {"byzantine": 0, "krum_keep": placeholder(int)},
        {"byzantine": BYZANTINE,
         "krum_keep": between(1, 1e5, integer=True, optional=True)},
        check=_krum_check,
        reference=Reference(
            "Blanchard et al., NeurIPS 2017 (Krum: score = sum of squared distances to the "
            "n - f - 2 nearest); El Mhamdi et al., ICML 2018 (Multi-Krum: average the m "
            "best)", None,
            ("the m chosen are averaged with the round's weights renormalised (the paper's "
             "plain mean, equal under the default uniform weights)",
             "f and m are checked against the clients a round before the run; a round "
             "with fewer present (late clients, Poisson sampling) scores each on its "
             "max(n - f - 2, 1) nearest and averages clip(m, 1, n) of its n")),
        summary="tolerating `byzantine` clients a round, averages the `krum_keep` outputs "
                "of lowest Krum score (None: all but `byzantine`; 1: Krum)"),
    "geometric_median": RuleEntry(
        lambda options, context: geometric_median(), {}, {}, check=_unread(),
        reference=Reference(
            "Pillutla et al., IEEE TSP 2022 (RFA: smoothed Weiszfeld, Alg. 2)", None,
            ("maxiter 4, eps 1e-5, ftol 1e-6 are the defaults the module docstring "
             "attributes to the authors' code, which is not pinned here",)),
        summary="RFA's smoothed-Weiszfeld geometric median of the outputs"),
    "zeno": RuleEntry(
        lambda options, context: zeno(options.byzantine, options.zeno.rho, context.score),
        {"byzantine": 0, "zeno": {"rho": 5e-4}},
        {"byzantine": BYZANTINE, "zeno.rho": between(0, 1e4)},
        check=_zeno_check, public=True,
        reference=Reference(
            "Xie et al., ICML 2019 (Zeno: score f_r(x) - f_r(x - gamma g_i) - rho gamma^2 "
            "||g_i||^2, keep the n - b best)", None,
            ("scores clients' models, x - gamma g_i read as the client's model x_i "
             "(FedAvg's update standing for gamma g_i): the paper scores gradients of one "
             "SGD step",
             "f_r is the loss over the whole held-out public set (`dataset.public_size`), "
             "not a fresh mini-batch each round",
             "the kept models are averaged with the round's weights renormalised (the "
             "paper's plain mean, equal under the default uniform weights)",
             "b < the clients a round is checked before the run (the paper's m > b); a "
             "round with n <= b present (late clients, Poisson sampling) keeps its best "
             "one")),
        summary="keeps all but `byzantine` models by their descent on the public set, "
                "less `zeno.rho` times the squared step"),
    "sageflow": RuleEntry(
        _sageflow,
        {"sageflow": {"entropy_threshold": 1.0, "delta": 1.0, "lam": 0.5,
                      "gamma_period": 20, "min_weight": 1e-3}},
        {"sageflow.entropy_threshold": between(1e-6, 100),
         "sageflow.delta": between(0, 10),
         "sageflow.lam": between(0, 10),
         "sageflow.gamma_period": between(0, 1e6, integer=True),
         "sageflow.min_weight": between(0, 1e6)},
        check=_unread(), public=True,
        reference=Reference(
            "Park et al., 'Sageflow: Robust Federated Learning against Both Stragglers and "
            "Adversaries', NeurIPS 2021 (entropy filter, loss-weighted averaging, "
            "staleness-aware grouping, Alg. 1)",
            SAGEFLOW + ": Sageflow_code/utils1.py (Eflow, Sag), Sageflow.py",
            ("if every group is dropped the model stays (the authors' Sag divides by zero)",
             "a dropped group gets weight 0 from round 0 (theirs only from round >= "
             "staleness)",
             "`aggregation.weights='num_examples'` restores the paper's m_k, which the "
             "authors' code drops (the default uniform weights equal their code)",
             "clients train on all their data (the authors train on 80%)",
             "the default protocol is this library's (a fixed attacker set, every delay "
             "drawn, one federation for every defence); the `authors` preset of "
             "configs/fmnist_robust.py and experiments/robustness.py follows theirs except "
             "their 10-epoch backdoor attackers and round count")),
        summary="drops models of high entropy on the public set, weighs the rest by their "
                "public loss within staleness groups and the groups by staleness; gamma "
                "halves every `gamma_period` rounds when clients can be late"),
    "fedasync": RuleEntry(
        _fedasync,
        {"fedasync": {"mixing": 0.6, "staleness": "polynomial", "a": 0.5, "b": 4.0}},
        {"fedasync.mixing": between(0, 1, lo_open=True),
         "fedasync.staleness": one_of(FEDASYNC_KINDS),
         "fedasync.a": between(0, 100),
         "fedasync.b": between(0, 1e6)},
        check=_unread(),
        reference=Reference(
            "Xie et al., 'Asynchronous Federated Optimization', 2019 (FedAsync: x <- (1 - "
            "a_t) x + a_t x_new, a_t = a s(t - tau), polynomial or hinge s)", None,
            ("a round's arrivals are grouped by staleness and each group's mean is mixed "
             "in, stalest first, not one model at a time: the simulator advances in "
             "rounds",)),
        summary="mixes each staleness group's mean into the model with weight `mixing` "
                "times s(staleness), s polynomial, hinge or constant"),
    "auto_weights": RuleEntry(
        _auto_weights,
        # lr: dL/dtheta_i = alpha_i <grad L(mix), m_i - mix>, near alpha_i times the gap
        # between model i's public loss and the mix's: small, so rate 1. On Fashion-MNIST
        # (configs/fmnist_mlp.py:pans_off, 10 non-IID models a round, rounds 1-3) 10 steps of rate 1
        # move the weights from 0.1 to 0.05-0.19 and lower the public loss 0.3-7%; rate 10
        # overshoots (round 3: loss 1.79 -> 3.49, one model takes all the weight).
        # apply=False: the weights are learned and reported (FAIR's quality estimate) but
        # the round's own weights mix the models.
        {"auto_weights": {"steps": 10, "lr": 1.0, "apply": True}},
        {"auto_weights.steps": between(1, 1000, integer=True),
         "auto_weights.lr": between(0, 1e4, lo_open=True),
         "auto_weights.apply": Rule(boolean)},
        check=_unread(), public=True,
        reference=Reference(
            "Deng et al., FAIR, IEEE INFOCOM 2021; extended in IEEE TPDS 33(12) 2022 "
            "(auto-weighted model aggregation: weights learned by gradient descent)", None,
            ("the papers' text is not at hand: every choice below is this library's",
             "alpha = softmax(theta) over the round's present models (absent slots 0)",
             "theta starts at the log of the round's weights (`aggregation.weights`: "
             "uniform or data sizes), so step 0 is the weighted mean",
             "plain gradient descent on theta, `auto_weights.steps` steps of rate "
             "`auto_weights.lr`, by autodiff through the scorer; no regulariser",
             "the loss is the mixed model's mean cross-entropy on the server's labelled "
             "public set (`dataset.public_size`), every leaf (BatchNorm statistics too) "
             "mixed with the same alpha",
             "the INFOCOM version's quality-weighted averaging and filtering of non-ideal "
             "updates is not reproduced")),
        summary="mixes the models with weights learned by `auto_weights.steps` steps of "
                "gradient descent (rate `auto_weights.lr`) on their softmax logits, "
                "lowering the mix's public loss from the round's weights"),
}


def _flat(options: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _same_default(a: Any, b: Any) -> bool:
    # Placeholders (FieldReference) compare by their declared type and value.
    if isinstance(a, FieldReference) or isinstance(b, FieldReference):
        return (isinstance(a, FieldReference) and isinstance(b, FieldReference)
                and a.get_type() is b.get_type() and a.get() == b.get())
    return type(a) is type(b) and a == b


def _merged(table: Mapping[str, RuleEntry]) -> Tuple[Dict[str, Any], Dict[str, Rule]]:
    """(dotted key -> default, dotted key -> Rule) over the entries of `table`, in table
    order; ValueError where an entry's options and rules name different keys, or two
    entries declare one key differently."""
    defaults: Dict[str, Any] = {}
    rules: Dict[str, Rule] = {}
    for name, entry in table.items():
        flat = _flat(entry.options)
        if set(flat) != set(entry.rules):
            raise ValueError(f"aggregation rule {name!r}: options {sorted(flat)} and rules "
                             f"{sorted(entry.rules)} name different keys")
        for key, value in flat.items():
            if key in defaults and not (_same_default(defaults[key], value)
                                        and rules[key] == entry.rules[key]):
                raise ValueError(f"aggregation rule {name!r} declares aggregation.{key} "
                                 f"unlike an earlier rule (its default or its Rule differ)")
            defaults.setdefault(key, value)
            rules.setdefault(key, entry.rules[key])
    return defaults, rules


def config_options(table: Mapping[str, RuleEntry] = RULES) -> Dict[str, Any]:
    """The keys of `config.aggregation` the rules of `table` read, with their defaults,
    nested as in the config (a fresh copy: placeholders are never shared)."""
    out: Dict[str, Any] = {}
    for key, value in _merged(table)[0].items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return copy.deepcopy(out)


def config_rules(table: Mapping[str, RuleEntry] = RULES) -> Dict[str, Rule]:
    """The schema rules of `config.aggregation` the rules of `table` add, relative to it:
    'rule' (one of the table's names) and each key the rules read."""
    return {"rule": one_of(tuple(table)), **_merged(table)[1]}


def public_rules(table: Mapping[str, RuleEntry] = RULES) -> Tuple[str, ...]:
    """The rules that score models on the server's labelled public set."""
    return tuple(name for name, entry in table.items() if entry.public)


def from_config(cfg: Any, model: Any = None, public: Any = None,
                public_labels: Any = None, late: bool = False) -> Aggregator:
    """The rule `cfg.aggregation.rule` names, configured by `cfg.aggregation`; a public
    rule scores `model` on the server's `public` images and their `public_labels`; `late`:
    clients can answer late (`stragglers.late(cfg)`)."""
    name = cfg.aggregation.rule
    if name not in RULES:
        raise ValueError(f"unknown aggregation rule {name!r}; expected one of "
                         f"{tuple(RULES)}")
    entry = RULES[name]
    score = public_scorer(model, public, public_labels) if entry.public else None
    return entry.build(cfg.aggregation, RuleContext(score, late))


_merged(RULES)  # a table whose entries disagree fails at import


__all__ = ["RuleEntry", "RuleContext", "RULES", "BYZANTINE", "PUBLIC_SIZE", "config_options",
           "config_rules", "public_rules", "from_config", "coordinate", "robust", "staleness",
           "median", "trimmed_mean", "multi_krum", "geometric_median", "zeno", "public_scorer",
           "krum_kept", "zeno_kept", "krum_scores", "pairwise_sq_distances", "fedasync", "sageflow",
           "staleness_weight", "FEDASYNC_KINDS", "learned", "auto_weights", "learn_weights"]
