"""Builds a configured algorithm by name; the engine itself never sees these names.

Each algorithm owns a config namespace `config.<name>` (its `OPTIONS`, checked by its
`RULES`); `defaults.default_config` and `schema.RULES` are assembled from this table, so
neither knows any algorithm's options.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import flax.linen as nn
import jax
import numpy as np
import optax

from fedjax_pan.algorithms import core
from fedjax_pan.algorithms.core import AlgorithmEntry, FederatedAlgorithm
from fedjax_pan.algorithms.apfl import ENTRY as APFL
from fedjax_pan.algorithms.apple import ENTRY as APPLE
from fedjax_pan.algorithms.ditto import ENTRY as DITTO
from fedjax_pan.algorithms.fed2 import ENTRY as FED2
from fedjax_pan.algorithms.fedala import ENTRY as FEDALA
from fedjax_pan.algorithms.fedcp import ENTRY as FEDCP
from fedjax_pan.algorithms.fedda import ENTRY as FEDDA
from fedjax_pan.algorithms.fedpac import ENTRY as FEDPAC
from fedjax_pan.algorithms.gpfl import ENTRY as GPFL
from fedjax_pan.algorithms.feddbe import ENTRY as FEDDBE
from fedjax_pan.algorithms.fedcac import ENTRY as FEDCAC
from fedjax_pan.algorithms.fedas import ENTRY as FEDAS
from fedjax_pan.algorithms.fedcross import ENTRY as FEDCROSS
from fedjax_pan.algorithms.fedbabu import ENTRY as FEDBABU
from fedjax_pan.algorithms.fedgc import ENTRY as FEDGC
from fedjax_pan.algorithms.fedlc import ENTRY as FEDLC
from fedjax_pan.algorithms.fedntd import ENTRY as FEDNTD
from fedjax_pan.algorithms.fedfomo import ENTRY as FEDFOMO
from fedjax_pan.algorithms.fedamp import ENTRY as FEDAMP
from fedjax_pan.algorithms.fedphp import ENTRY as FEDPHP
from fedjax_pan.algorithms.fedproto import ENTRY as FEDPROTO
from fedjax_pan.algorithms.fd import ENTRY as FD
from fedjax_pan.algorithms.fml import ENTRY as FML
from fedjax_pan.algorithms.fedkd import ENTRY as FEDKD
from fedjax_pan.algorithms.fedgh import ENTRY as FEDGH
from fedjax_pan.algorithms.fedpcl import ENTRY as FEDPCL
from fedjax_pan.algorithms.fedgen import ENTRY as FEDGEN
from fedjax_pan.algorithms.fedavg import REFERENCE as FEDAVG_REFERENCE, fedavg
from fedjax_pan.algorithms.fedmtl import ENTRY as FEDMTL
from fedjax_pan.algorithms.feddyn import ENTRY as FEDDYN
from fedjax_pan.algorithms.fedma import ENTRY as FEDMA
from fedjax_pan.algorithms.flchain import ENTRY as FLCHAIN
from fedjax_pan.algorithms.fedprox import ENTRY as FEDPROX
from fedjax_pan.algorithms.fedrep import ENTRY as FEDREP
from fedjax_pan.algorithms.fedrod import ENTRY as FEDROD
from fedjax_pan.algorithms.ktpfl import ENTRY as KTPFL
from fedjax_pan.algorithms.local import client_optimizer
from fedjax_pan.algorithms.moon import ENTRY as MOON
from fedjax_pan.algorithms.partialfed import ENTRY as PARTIALFED
from fedjax_pan.algorithms.perfedavg import ENTRY as PERFEDAVG
from fedjax_pan.algorithms.personal import ENTRIES as PERSONAL
from fedjax_pan.algorithms.pfedeff import ENTRY as PFEDEFF
from fedjax_pan.algorithms.pfedme import ENTRY as PFEDME
from fedjax_pan.algorithms.scaffold import ENTRY as SCAFFOLD
from fedjax_pan.algorithms.siren import ENTRY as SIREN
from fedjax_pan import compression
from fedjax_pan.algorithms import attacks, compressed, dp, local
from fedjax_pan.engine import robust, staleness
from fedjax_pan.engine.simulation import SAMPLINGS, clients_per_round
from fedjax_pan.references import SAGEFLOW, Reference

SERVER_OPTIMIZERS = ("sgd", "adam", "yogi")
AGGREGATION_RULES = ("mean", "median", "trimmed_mean", "multi_krum", "geometric_median",
                     "zeno", "sageflow", "fedasync")
# Each rule's reference (`fedjax_pan.fidelity`).
RULE_REFERENCES: Dict[str, Reference] = {
    "mean": Reference(
        "McMahan et al., AISTATS 2017 (FedAvg, Alg. 1: w <- sum_k n_k / n w_k)", None,
        ("the default `aggregation.weights='uniform'` counts each client 1, as the PAN "
         "authors' code (SPEC 3); 'num_examples' is the paper's n_k / n",)),
    "median": Reference("Yin et al., ICML 2018 (coordinate-wise median, Alg. 1 option I)",
                        None, ()),
    "trimmed_mean": Reference(
        "Yin et al., ICML 2018 (coordinate-wise beta-trimmed mean, Alg. 1 option II)", None,
        ("floor(trim n) values cut at each end of the n present (the paper's beta n, "
         "rounded down where beta n is not whole)",)),
    "multi_krum": Reference(
        "Blanchard et al., NeurIPS 2017 (Krum: score = sum of squared distances to the "
        "n - f - 2 nearest); El Mhamdi et al., ICML 2018 (Multi-Krum: average the m best)",
        None,
        ("the m chosen are averaged with the round's weights renormalised (the paper's "
         "plain mean, equal under the default uniform weights)",)),
    "geometric_median": Reference(
        "Pillutla et al., IEEE TSP 2022 (RFA: smoothed Weiszfeld, Alg. 2)", None,
        ("maxiter 4, eps 1e-5, ftol 1e-6 are the defaults the module docstring attributes "
         "to the authors' code, which is not pinned here",)),
    "zeno": Reference(
        "Xie et al., ICML 2019 (Zeno: score f_r(x) - f_r(x - gamma g_i) - rho gamma^2 "
        "||g_i||^2, keep the n - b best)", None,
        ("scores clients' models, x - gamma g_i read as the client's model x_i (FedAvg's "
         "update standing for gamma g_i): the paper scores gradients of one SGD step",
         "f_r is the loss over the whole held-out public set (`dataset.public_size`), not "
         "a fresh mini-batch each round",
         "the kept models are averaged with the round's weights renormalised (the paper's "
         "plain mean, equal under the default uniform weights)")),
    "sageflow": Reference(
        "Park et al., 'Sageflow: Robust Federated Learning against Both Stragglers and "
        "Adversaries', NeurIPS 2021 (entropy filter, loss-weighted averaging, "
        "staleness-aware grouping, Alg. 1)",
        SAGEFLOW + ": Sageflow_code/utils1.py (Eflow, Sag), Sageflow.py",
        ("if every group is dropped the model stays (the authors' Sag divides by zero)",
         "a dropped group gets weight 0 from round 0 (theirs only from round >= staleness)",
         "`aggregation.weights='num_examples'` restores the paper's m_k, which the authors' "
         "code drops (the default uniform weights equal their code)",
         "clients train on all their data (the authors train on 80%)",
         "the default protocol is this library's (a fixed attacker set, every delay drawn, "
         "one federation for every defence); the `authors` preset of "
         "configs/fmnist_robust.py and experiments/robustness.py follows theirs except "
         "their 10-epoch backdoor attackers and round count")),
    "fedasync": Reference(
        "Xie et al., 'Asynchronous Federated Optimization', 2019 (FedAsync: x <- (1 - a_t) "
        "x + a_t x_new, a_t = a s(t - tau), polynomial or hinge s)", None,
        ("a round's arrivals are grouped by staleness and each group's mean is mixed in, "
         "stalest first, not one model at a time: the simulator advances in rounds",)),
}
# Rules that score models on the server's labelled public set.
PUBLIC_RULES = ("zeno", "sageflow")
PUBLIC_DEFAULT = 1000  # SageFlow's public set (the authors' num_commondata)


def server_optimizer(name: str, learning_rate: float, momentum: float = 0.0,
                     b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3
                     ) -> optax.GradientTransformation:
    """sgd(lr=1, momentum=0) is FedAvg; sgd with momentum FedAvgM; adam/yogi FedAdam/FedYogi."""
    if name == "sgd":
        return optax.sgd(learning_rate, momentum=momentum or None)
    if name == "adam":
        return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
    if name == "yogi":
        return optax.yogi(learning_rate, b1=b1, b2=b2, eps=eps)
    raise ValueError(f"unknown server optimizer {name!r}; expected one of {SERVER_OPTIMIZERS}")


def _fedavg(model, cfg, client_tx, server_tx):
    return fedavg(model, client_tx, server_tx, bn=cfg.aggregation.bn)


ALGORITHMS: Dict[str, AlgorithmEntry] = {
    "fedavg": AlgorithmEntry(_fedavg, {}, {}, reference=FEDAVG_REFERENCE),
    "fedprox": FEDPROX,
    "scaffold": SCAFFOLD,
    "moon": MOON,
    "feddyn": FEDDYN,
    "fed2": FED2,
    "fedma": FEDMA,
    **PERSONAL,  # local, fedper, lg_fedavg, fedbn
    "fedrep": FEDREP,
    "ditto": DITTO,
    "apfl": APFL,
    "apple": APPLE,
    "perfedavg": PERFEDAVG,
    "pfedme": PFEDME,
    "fedrod": FEDROD,
    "fedala": FEDALA,
    "fedcp": FEDCP,
    "fedda": FEDDA,
    "fedpac": FEDPAC,
    "gpfl": GPFL,
    "feddbe": FEDDBE,
    "fedcac": FEDCAC,
    "fedas": FEDAS,
    "fedcross": FEDCROSS,
    "fedbabu": FEDBABU,
    "fedlc": FEDLC,
    "fedntd": FEDNTD,
    "fedgc": FEDGC,
    "fedfomo": FEDFOMO,
    "fedamp": FEDAMP,
    "fedphp": FEDPHP,
    "fedproto": FEDPROTO,
    "fd": FD,
    "fml": FML,
    "fedkd": FEDKD,
    "fedgh": FEDGH,
    "fedpcl": FEDPCL,
    "fedgen": FEDGEN,
    "fedmtl": FEDMTL,
    "partialfed": PARTIALFED,
    "pfedeff": PFEDEFF,
    "ktpfl": KTPFL,
    "siren": SIREN,
    "flchain": FLCHAIN,
}


def aggregator(rule: str, trim: float = 0.1, byzantine: int = 0,
               keep: Optional[int] = None, *, options: Any = None,
               score: Optional[Callable] = None, late: bool = False) -> core.Aggregator:
    """The aggregation rule `config.aggregation.rule` names (`trim`: trimmed_mean's share
    cut at each end; `byzantine`, `keep`: Multi-Krum's f and m, Zeno's b; `options`:
    `config.aggregation`, for zeno, sageflow and fedasync; `score`: the public-set scorer
    zeno and sageflow need; `late`: clients can answer late, so SageFlow's gamma applies)."""
    if rule == "median":
        return core.median()
    if rule == "trimmed_mean":
        return core.trimmed_mean(trim)
    if rule == "multi_krum":
        return robust.multi_krum(byzantine, keep)
    if rule == "geometric_median":
        return robust.geometric_median()
    if rule == "zeno":
        return robust.zeno(byzantine, options.zeno.rho, score)
    if rule == "sageflow":
        o = options.sageflow
        return staleness.sageflow(o.entropy_threshold, o.delta, o.lam,
                                  o.gamma_period if late else 0, score,
                                  o.get("min_weight", 1e-3))
    if rule == "fedasync":
        o = options.fedasync
        return staleness.fedasync(o.mixing, o.staleness, o.a, o.b)
    if rule == "mean":
        return core.weighted_mean
    raise ValueError(f"unknown aggregation rule {rule!r}; expected one of {AGGREGATION_RULES}")


def client_tx(cfg: Any) -> optax.GradientTransformation:
    """The clients' local optimiser `cfg.optimizer` describes."""
    opt = cfg.optimizer
    return client_optimizer(opt.lr, opt.momentum, opt.weight_decay, opt.grad_clip, opt.warmup,
                            opt.warmup_length)


def public_size(cfg: Any, num_train: int) -> int:
    """The training examples held out as unlabelled public data: `dataset.public_size`,
    or where that is 0 the default of an algorithm that distils on public data (at most a
    fifth of the `num_train` training examples)."""
    if cfg.dataset.public_size:
        return int(cfg.dataset.public_size)
    default = int(ALGORITHMS[cfg.algorithm].public)
    if cfg.aggregation.rule in PUBLIC_RULES:
        default = max(default, PUBLIC_DEFAULT)
    return min(default, num_train // 5)


def from_config(model: nn.Module, cfg: Any, public: Any = None, public_labels: Any = None,
                input_shape: Any = None) -> FederatedAlgorithm:
    """The algorithm `cfg.algorithm` for `model`, configured by `cfg`, with the
    aggregation rule it names (`attack_from_config` adds the attackers); `public`: the
    public images held out at the server (`public_labels` their labels: zeno and sageflow
    score models on them); `input_shape`: one example's (H, W, C), for algorithms that
    build a network of their own."""
    if cfg.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {cfg.algorithm!r}; available: {sorted(ALGORITHMS)}")
    server = cfg.server
    server_tx = server_optimizer(server.optimizer, server.lr, server.momentum)
    entry = ALGORITHMS[cfg.algorithm]
    extra: Dict[str, Any] = {}
    if entry.public:
        if public is None or len(public) == 0:
            raise ValueError(f"{cfg.algorithm} distils on unlabelled public data: set "
                             f"dataset.public_size > 0 (a held-out slice of the training set)")
        extra["public"] = public
    if entry.input_shape:
        if input_shape is None:
            raise ValueError(f"{cfg.algorithm} builds a network of its own: it needs the "
                             f"input shape")
        extra["input_shape"] = tuple(input_shape)
    algorithm = entry.build(model, cfg, client_tx(cfg), server_tx, **extra)
    agg = cfg.aggregation
    if agg.rule != "mean":
        if algorithm.aggregator is not core.weighted_mean:
            raise ValueError(f"{cfg.algorithm} aggregates its outputs its own way; "
                             f"aggregation.rule must be 'mean', got {agg.rule!r}")
        rule = aggregator(agg.rule, agg.trim, agg.byzantine, agg.krum_keep, options=agg,
                          score=(robust.public_scorer(model, public, public_labels)
                                 if agg.rule in PUBLIC_RULES else None),
                          late=cfg.straggler.max_delay > 0)
        if rule.space == "model" and algorithm.model_view is None:
            raise ValueError(f"aggregation.rule={agg.rule!r} combines models, and "
                             f"{cfg.algorithm}'s output is not a model or an update")
        algorithm = algorithm._replace(aggregator=rule)
    return algorithm


def attack_from_config(algorithm: FederatedAlgorithm, cfg: Any, num_clients: int,
                       num_classes: int, malicious: Optional[np.ndarray] = None
                       ) -> FederatedAlgorithm:
    """`algorithm` with `config.attack`'s malicious clients (unchanged for kind 'none');
    `malicious`: their table where the caller has it (`attacks.malicious_from_config`)."""
    a = cfg.attack
    if a.kind == "none":
        return algorithm
    scale = attacks.DEFAULT_SCALE.get(a.kind, 1.0) if a.scale is None else a.scale
    if a.kind == "backdoor" and a.target >= num_classes:
        raise ValueError(f"attack.target must be a class below {num_classes}, got {a.target}")
    attack = attacks.Attack(a.kind, num_classes, scale, a.target, a.poisoned, a.start_round)
    if malicious is None:
        malicious = attacks.malicious_from_config(cfg, num_clients, cohort_sampling(cfg))
    return attacks.with_attack(algorithm, attack, malicious)


def _transform(side: Any) -> Any:
    return compression.from_name(side.method, side.ratio, side.levels, side.bits,
                                 side.error_feedback, side.quantize_bits)


SAMPLING_CHOICES = ("auto",) + SAMPLINGS


def cohort_sampling(cfg: Any) -> str:
    """The sampling `config.sampling` names; 'auto' is Poisson under DP-FedAvg (its
    privacy analysis samples each client independently, `fedjax_pan.privacy`), else
    uniform."""
    if cfg.sampling == "auto":
        return "poisson" if cfg.privacy.clip > 0 else "uniform"
    return cfg.sampling


def expected_clients(cfg: Any, num_clients: int) -> float:
    """Clients a round takes in expectation: R K under Poisson sampling, else the fixed
    cohort max(1, round(R K)) (DP-FedAvg's denominator)."""
    if cohort_sampling(cfg) == "poisson":
        return cfg.participation * num_clients
    return float(clients_per_round(cfg.participation, num_clients))


def communication_from_config(algorithm: FederatedAlgorithm, cfg: Any, model: nn.Module,
                              variables: Any, num_clients: int) -> FederatedAlgorithm:
    """`algorithm` with `config.compression`'s transforms and `config.privacy`'s DP-FedAvg
    (unchanged when both are off): clients compress what they send, then clip it."""
    c, p = cfg.compression, cfg.privacy
    if c.upload.method != "none" or c.download.method != "none" or c.mask_before != "none":
        mask = None
        if c.mask_before != "none":
            mask = compressed.MaskBefore(c.upload.ratio, c.mask_before, c.mask_l1,
                                         cfg.optimizer.lr)

        def grad_fn(params, model_state, batch):
            return jax.grad(lambda w: local.mean_loss(model, w, model_state, batch)[0])(params)
        algorithm = compressed.with_compression(
            algorithm, variables, _transform(c.upload),
            target="model" if c.upload.method.endswith("_mask") else "update",
            download=None if c.download.method == "none" else _transform(c.download),
            num_clients=num_clients, seed=cfg.seed, vote=c.vote, mask_before=mask,
            grad_fn=grad_fn)
    if p.clip > 0:
        adaptive = (dp.AdaptiveClip(p.quantile, p.clip_lr, p.count_std) if p.adaptive
                    else None)
        algorithm = dp.with_dp(algorithm, p.clip, p.noise_multiplier,
                               expected_clients(cfg, num_clients), cfg.seed, adaptive)
    return algorithm
