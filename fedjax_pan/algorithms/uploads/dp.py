"""DP-FedAvg (McMahan et al., ICLR 2018) as a wrapper over any algorithm whose output is an
update (its `model_view`), with adaptive clipping (Andrew et al., NeurIPS 2021).

Each client's update Delta_k = w_k - w is clipped to norm C; the server adds Gaussian
noise once to the sum and divides by a fixed denominator, the expected number of clients
m = qK (not the number that took part):

    Delta = (sum_k Delta_k min(1, C / ||Delta_k||) + N(0, (z_Delta C)^2 I)) / m

and hands Delta to the algorithm's server update as the mean output (FedAvg: w + Delta).
Weights must be uniform (each client counts 1: the sensitivity is C).

Adaptive clipping (`adaptive`): each client also sends b_k = 1[||Delta_k|| <= C]; the
server estimates the fraction from the centred bits, b = (sum_k (b_k - 1/2) +
N(0, sigma_b^2)) / m + 1/2, and moves C geometrically towards the target quantile gamma:
C <- C exp(-eta (b - gamma)) (C0 0.1, gamma 0.5, eta 0.2, sigma_b = m / 20). Centring
halves the count's sensitivity to 1/2 when a client is added or removed (Andrew et al.
Sect. 3; TensorFlow Privacy's `QuantileEstimatorQuery` does the same), which is what
their split assumes: the update's noise multiplier is z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2),
so that both queries together cost the same as one Gaussian mechanism of multiplier z
(their Thm. 1): the accountant (`fedjax_pan.algorithms.uploads.privacy`) uses z.

Reference: McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018 (DP-FedAvg with the fixed denominator, Alg. 1); Andrew et al., "Differentially
Private Learning with Adaptive Clipping", NeurIPS 2021 (Alg. 1, Thm. 1).

The noise is drawn from (seed, round) alone. Models with non-trainable state (BatchNorm
statistics) are refused: their statistics would be released without noise.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
from ml_collections.config_dict import placeholder

from fedjax_pan.algorithms.uploads import privacy
from fedjax_pan.algorithms.core import (Aggregator, Build, FeatureEntry, FederatedAlgorithm,
                                        tree_bytes)
from fedjax_pan.algorithms.sampling import cohort_sampling, expected_clients
from fedjax_pan.algorithms.uploads import compressed
from fedjax_pan.algorithms import stragglers
from fedjax_pan.algorithms.wrapping import map_sent_update, nest_local, nest_server
from fedjax_pan.algorithms.uploads.compression import clip_by_norm
from fedjax_pan.engine.simulation import clients_per_round
from fedjax_pan.references import Reference
from fedjax_pan.rules import Rule, between, boolean

PyTree = Any
tree_map = jax.tree_util.tree_map
_NOISE_STREAM = 0xD9


class AdaptiveClip(NamedTuple):
    """Andrew et al.'s geometric update of the clip norm."""

    quantile: float = 0.5  # gamma, the target fraction of unclipped updates
    lr: float = 0.2  # eta
    count_std: Optional[float] = None  # sigma_b; None: m / 20


class DPServer(NamedTuple):
    inner: PyTree
    clip: jax.Array  # C this round


class DPLocal(NamedTuple):
    inner: PyTree
    clip: jax.Array


def counting_std(count_std: Optional[float], expected_clients: float) -> float:
    """sigma_b: `count_std`, or Andrew et al.'s m / 20 where it is None."""
    return expected_clients / 20.0 if count_std is None else count_std


def update_noise_multiplier(z: float, count_std: float) -> float:
    """z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) (adaptive clipping's split)."""
    if z <= 0:
        return 0.0
    rest = z ** -2 - (2.0 * count_std) ** -2
    if rest <= 0:
        raise ValueError(f"noise multiplier {z} leaves no noise for the update with the "
                         f"counting query's sigma_b = {count_std}: needs z < 2 sigma_b")
    return rest ** -0.5


def _add_sum(output_sum: PyTree, total_weight: Any) -> PyTree:
    del total_weight
    return output_sum


# The clients' sum as it is: the server update adds the noise and divides by m, also in a
# round without clients.
DP_SUM = Aggregator(_add_sum, closes_empty=True)


# The privacy mechanisms a config can select (`config.privacy`, `config.sampling`).
MECHANISMS = ("dp_fedavg", "adaptive_clipping", "accountant")
REFERENCES = {
    "dp_fedavg": Reference(
        "McMahan et al., 'Learning Differentially Private Recurrent Language Models', "
        "ICLR 2018 (DP-FedAvg, Alg. 1: per-client clipping, the fixed denominator qK, "
        "Gaussian noise of std z C on the sum)", None,
        ("uniform client weights only (the paper's weighted estimator with capped weights "
         "is not offered): each client's sensitivity is then C",
         "models with non-trainable state (BatchNorm) are refused: their statistics would "
         "be released without noise")),
    "adaptive_clipping": Reference(
        "Andrew et al., 'Differentially Private Learning with Adaptive Clipping', NeurIPS "
        "2021 (Alg. 1 with the centred bits b_k - 1/2, geometric update, Thm. 1's noise "
        "split)", None, ()),
    "accountant": Reference(
        "Mironov 2017 (RDP); Mironov et al. 2019 (Poisson-sampled Gaussian, add/remove one "
        "client); Wang et al., AISTATS 2019 (sampling without replacement, replace one "
        "client), as dp-accounting's RdpAccountant composes them", None,
        ("uniform cohorts are accounted under replace-one neighbours (the sum's "
         "sensitivity 2 C, multiplier z / 2): their epsilon is not comparable with "
         "Poisson's add/remove epsilon, which is the default under DP "
         "(config.sampling='auto')",)),
}


def with_dp(algorithm: FederatedAlgorithm, clip: float, noise_multiplier: float,
            expected_clients: float, seed: int, adaptive: Optional[AdaptiveClip] = None
            ) -> FederatedAlgorithm:
    """`algorithm` under DP-FedAvg with clip norm `clip` (adaptive: its initial value),
    noise multiplier z = `noise_multiplier`, fixed denominator m = `expected_clients`."""
    if algorithm.model_view is None:
        raise ValueError("DP-FedAvg clips an update, and this algorithm's output is not one")
    if clip <= 0 or expected_clients <= 0 or noise_multiplier < 0:
        raise ValueError(f"DP-FedAvg needs clip > 0, expected clients > 0 and a noise "
                         f"multiplier >= 0, got {clip}, {expected_clients}, {noise_multiplier}")
    m = float(expected_clients)
    count_std = None
    z_update = noise_multiplier
    if adaptive is not None:
        count_std = counting_std(adaptive.count_std, m)
        z_update = update_noise_multiplier(noise_multiplier, count_std)
    base_key = jax.random.fold_in(jax.random.PRNGKey(seed), _NOISE_STREAM)
    nested = nest_local(nest_server(algorithm, lambda server: server.inner))

    def server_init(variables):
        inner = algorithm.server_init(variables)
        state = algorithm.eval_variables(inner)
        if jax.tree_util.tree_leaves({k: v for k, v in state.items() if k != "params"}):
            raise ValueError("DP-FedAvg releases only noised parameters, and this model keeps "
                             "non-trainable state (BatchNorm statistics): use a model without "
                             "it, e.g. model.norm='group'")
        return DPServer(inner, jnp.float32(clip))

    def client_init(server, client_state, ctx):
        return DPLocal(nested.client_init(server, client_state, ctx), server.clip)

    def client_output(local, server):
        output, client_state = nested.client_output(local, server)
        update, norm = map_sent_update(
            nested, server, output, lambda update, _: clip_by_norm(update, local.clip))
        out = {"update": update}
        if adaptive is not None:
            # The centred bit b_k - 1/2 (module docstring).
            out["unclipped"] = (norm <= local.clip).astype(jnp.float32) - 0.5
        return out, client_state

    def upload_bytes(output, local):
        inner = (nested.upload_bytes(output["update"], local)
                 if nested.upload_bytes is not None else tree_bytes(output["update"]))
        return inner + (1 if adaptive is not None else 0)  # the bit b_k, in one byte

    def server_update(server, aggregate, info):
        key = jax.random.fold_in(base_key, info.round)
        k_update, k_count = jax.random.split(key)
        std = z_update * server.clip

        def noised(total, _):
            leaves, treedef = jax.tree_util.tree_flatten(total)
            keys = jax.random.split(k_update, len(leaves))
            return jax.tree_util.tree_unflatten(treedef, [
                (v + std * jax.random.normal(k, v.shape, jnp.float32)).astype(v.dtype) / m
                for v, k in zip(leaves, keys)]), None
        # The sum of outputs stands for the sum of clipped updates (the view is linear).
        mean, _ = map_sent_update(nested, server, aggregate["update"], noised)
        inner = nested.server_update(server, mean, info)
        c = server.clip
        if adaptive is not None:
            b = (aggregate["unclipped"] + count_std * jax.random.normal(k_count)) / m + 0.5
            c = c * jnp.exp(-adaptive.lr * (b - adaptive.quantile))
        return DPServer(inner, c.astype(jnp.float32))

    return nested._replace(
        server_init=server_init, client_init=client_init, client_output=client_output,
        server_update=server_update, aggregator=DP_SUM, upload_bytes=upload_bytes,
        model_view=None)


def _check(cfg: Any) -> None:
    dp = cfg.privacy
    if dp.clip <= 0:
        if dp.noise_multiplier != 0 or dp.adaptive:
            raise ValueError("privacy.noise_multiplier and privacy.adaptive need "
                             "privacy.clip > 0")
        return
    if cfg.aggregation.weights != "uniform":
        raise ValueError(f"privacy.clip > 0 (DP-FedAvg) needs aggregation.weights='uniform' "
                         f"(each client's sensitivity is the clip norm), got "
                         f"{cfg.aggregation.weights!r}")
    if cfg.aggregation.rule != "mean":
        raise ValueError(f"privacy.clip > 0 (DP-FedAvg) adds its noise to the clients' sum: "
                         f"aggregation.rule must be 'mean', got {cfg.aggregation.rule!r}")
    if compressed.server_side(cfg):
        raise ValueError("privacy.clip > 0 (DP-FedAvg) clips updates against the model the "
                         "server sends: set compression.download.method='none' and "
                         "compression.vote=False")
    if stragglers.late(cfg):
        raise ValueError("privacy.clip > 0 (DP-FedAvg) needs straggler.max_delay=0")
    if dp.adaptive and dp.noise_multiplier > 0:
        std = counting_std(dp.count_std, expected_clients(cfg, cfg.partition.num_clients))
        if not dp.noise_multiplier < 2 * std:
            raise ValueError(
                f"privacy.noise_multiplier = {dp.noise_multiplier} must be below 2 * "
                f"privacy.count_std = {2 * std:g} with privacy.adaptive (the update's share "
                f"of the noise, (z^-2 - (2 sigma_b)^-2)^(-1/2), must be real)")


def _wrap(algorithm: FederatedAlgorithm, build: Build) -> FederatedAlgorithm:
    p = build.cfg.privacy
    adaptive = AdaptiveClip(p.quantile, p.clip_lr, p.count_std) if p.adaptive else None
    return with_dp(algorithm, p.clip, p.noise_multiplier,
                   expected_clients(build.cfg, build.num_clients), build.cfg.seed, adaptive)


def _epsilon(cfg: Any, num_clients: int) -> Dict[str, Callable[[int], float]]:
    """Epsilon at `privacy.delta` after each evaluated round (`uploads.privacy`)."""
    sampling = cohort_sampling(cfg)
    ledger = privacy.Ledger(cfg.privacy.noise_multiplier, cfg.privacy.delta, sampling,
                            num_clients, clients_per_round(cfg.participation, num_clients),
                            cfg.participation if sampling == "poisson" else None)
    return {"dp_epsilon": ledger.epsilon}


FEATURE = FeatureEntry(
    "privacy",
    options={"clip": 0.0, "noise_multiplier": 0.0, "delta": 1e-5, "adaptive": False,
             "quantile": 0.5, "clip_lr": 0.2, "count_std": placeholder(float)},
    rules={"clip": between(0, 1e6), "noise_multiplier": between(0, 1e4),
           "delta": between(0, 1, lo_open=True, hi_open=True), "adaptive": Rule(boolean),
           "quantile": between(0, 1), "clip_lr": between(0, 100),
           "count_std": between(0, 1e6, lo_open=True, optional=True)},
    off=(("clip", 0),), check=_check, wrap=_wrap, needs_model=lambda cfg: True,
    round_fields=_epsilon,
    summary="DP-FedAvg (module docstring) when clip > 0: updates clipped to `clip` "
            "(adaptive: its start, moved towards the `quantile` of update norms at rate "
            "clip_lr, counting noise count_std, None: m / 20), noise multiplier z on the "
            "sum, epsilon at `delta` logged each evaluated round (algorithms/uploads/"
            "privacy.py)")


__all__ = ["FEATURE", "MECHANISMS", "REFERENCES", "AdaptiveClip", "DPServer", "DPLocal", "DP_SUM",
           "counting_std", "update_noise_multiplier", "with_dp"]
