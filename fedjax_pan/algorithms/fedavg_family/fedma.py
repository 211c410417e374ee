"""FedMA (Wang et al., ICLR 2020): federated matched averaging, layer by layer.

One FedMA round over the sampled clients (IBM's released code, `--comm_type=fedma`):
  1. each client trains the global model for E local epochs;
  2. for each hidden layer l, input to output, the server matches the clients' neurons of
     layer l by BBP-MAP (`matching.bbp_map`; a neuron is its incoming weights and bias,
     whose inputs are already in the global order), so the global layer holds the matched
     posterior means and may be wider than any client's. Each client receives it with its
     assignment, moves its layer l+1's input rows to the global positions of the neurons
     they came from (zeros for global neurons it does not hold), freezes layers <= l and
     retrains the rest for `retrain_epochs`;
  3. the head is averaged, output c weighted by each client's count of class c.

The global model's widths are the matched layers', so the network is rebuilt every round
(`models.resized`) and evaluated as such. Matching needs scipy and host arrays, so a FedMA
round is a driver in Python between compiled calls (`FedMA`, an `engine.protocol.Round`);
every local training and retraining is the engine's (`engine.services`: the strategies and
compiled step loop every algorithm uses), one executor per network shape and frozen set,
reused while widths stay the same.

MLP and VGG, without normalisation and without PANs, as IBM's code: a PAN pins a neuron's
encoding to its position, which matching reorders.

As IBM's code by default: a client opens at most min(L_j, max(700 - L, 1)) new neurons when
matched against L global ones (`width_cap`; 0: none); the retraining after the last hidden
layer, where only the head is left to train, takes 3x the epochs at a tenth of the
learning rate with weight decay 1e-4 (`head_retrain = "ibm"`; "same": as the other
retrainings). IBM's first round starts every client from its own random initialisation
(`own_init = True`; the default starts them all from the global model, as every other
algorithm here, so that runs compare from one initial model). The prior mean `mu0_bias`
sits on each neuron's bias on every layer, as in IBM's first layer (its later layers put
it on the first incoming weight instead; `matching.bbp_map`).

Bytes counted per round: up, every client's matched layers (weights and biases) and head;
down, the global model at the start, then each matched layer and the client's assignment
(int32 per neuron).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections.config_dict import placeholder

from fedjax_pan.pan import matching
from fedjax_pan import models
from fedjax_pan.pan import permutation as perm_lib
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, tree_bytes,
                                        weighted_sum)
from fedjax_pan.algorithms.fedavg_family.finetune import fine_tuning
from fedjax_pan.engine import LocalWork
from fedjax_pan.engine.services import RoundDefaults, Services, SimState
from fedjax_pan.references import Reference
from fedjax_pan.rules import Rule, between, boolean, one_of

PyTree = Any
Variables = Dict[str, Any]
OWN_INIT_STREAM = 0xFED  # folded into the seed's key for the clients' own initialisations

HEAD_RETRAINS = ("ibm", "same")

REFERENCE = Reference(
    "Wang et al., 'Federated Learning with Matched Averaging', ICLR 2020 (FedMA, Alg. 1: "
    "layer-wise BBP-MAP matching, Eq. 3-4, then retraining of the layers above)", None,
    ("where the paper leaves choices open this module follows IBM's released FedMA code "
     "(--comm_type=fedma), as its docstring says; that code is not pinned here: the new-"
     "neuron cap min(L_j, max(700 - L, 1)) and the head retraining (3x the epochs, a tenth "
     "of the rate, weight decay 1e-4) are its defaults",
     "every client starts round 1 from the global model (own_init=False); IBM's code starts "
     "each from its own random initialisation (own_init=True)",
     "the prior mean mu0_bias sits on each neuron's bias on every layer; IBM's code puts it "
     "there on the first layer only (later layers: on the first incoming weight)",
     "MLP and VGG without normalisation and without PANs only; the head is averaged per "
     "class, weighted by the clients' class counts"))
OPTIONS = {"sigma": 1.0, "sigma0": 1.0, "mu0_bias": 0.1, "gamma": 7.0, "iterations": 5,
           "retrain_epochs": placeholder(float), "width_cap": 700, "own_init": False,
           "head_retrain": "ibm"}
# The matching squares 1 / sigma^2 and 1 / sigma0^2 into its costs; gamma enters as a log.
# A sweep of `iterations` re-matches every client (16 clients of 512 3x3x256 filters: 40 s
# a layer on a CPU), so 100 sweeps bound a round's matching to about an hour a layer.
RULES = {"sigma": between(1e-4, 1e4), "sigma0": between(1e-4, 1e4),
         "mu0_bias": between(-100, 100), "gamma": between(1e-6, 1e6),
         "iterations": between(0, 100, integer=True),
         "retrain_epochs": between(0, 1000, optional=True),
         # 0: no cap. IBM's 700 bounds a layer's growth; 1e6 neurons is far past any layer.
         "width_cap": between(0, 1e6, integer=True), "own_init": Rule(boolean),
         "head_retrain": one_of(HEAD_RETRAINS)}


def freeze(tx: optax.GradientTransformation, frozen: Sequence[str]
           ) -> optax.GradientTransformation:
    """`tx` on every layer but those named in `frozen`, whose updates are zero."""
    if not frozen:
        return tx
    frozen = frozenset(frozen)

    def labels(params):
        return {name: jax.tree_util.tree_map(lambda _: "frozen" if name in frozen else "train",
                                             leaves) for name, leaves in params.items()}
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def local_training(model: nn.Module, tx: optax.GradientTransformation,
                   frozen: Sequence[str] = ()) -> FederatedAlgorithm:
    """Each client trains its own model (its client state) with the layers in `frozen`
    fixed and returns the trained model as its new state; it outputs nothing (the round
    of `finetune.fine_tuning`, on no server state)."""
    tuning = fine_tuning(model, freeze(tx, frozen))
    return FederatedAlgorithm(lambda v: None, lambda s: None, tuning.client_init,
                              tuning.client_step, tuning.client_output, lambda s, a, i: s,
                              lambda s: s, weighted_sum)


# ----------------------------------------------------------------------------------------
# Layers as neuron matrices, and the patching of the next layer's inputs.
# ----------------------------------------------------------------------------------------

def neuron_matrix(layer: Dict[str, np.ndarray]) -> np.ndarray:
    """(L, D): one row per output neuron of a Dense or Conv layer (kernel (..., in, L)),
    its incoming weights then its bias."""
    kernel = np.asarray(layer["kernel"])
    rows = np.moveaxis(kernel, -1, 0).reshape(kernel.shape[-1], -1)
    return np.hstack([rows, np.asarray(layer["bias"])[:, None]])


def from_neuron_matrix(rows: np.ndarray, kernel_shape: Tuple[int, ...]) -> Dict[str, Any]:
    """Inverse of `neuron_matrix` for L = len(rows) neurons with kernel (..., in, *)."""
    kernel = rows[:, :-1].reshape(len(rows), *kernel_shape[:-1])
    return {"kernel": np.moveaxis(kernel, 0, -1).astype(np.float32),
            "bias": rows[:, -1].astype(np.float32)}


def _place(leaf: np.ndarray, axis: int, entry: Any, assign: np.ndarray, width: int
           ) -> np.ndarray:
    """`leaf` with its input axis (of the layer `assign` maps) widened to `width`: client
    neuron i's slice moves to global position assign[i], other positions are zero."""
    moved = np.moveaxis(np.asarray(leaf), axis, 0)
    if isinstance(entry, perm_lib.Flat):  # (spatial, channels) flattened, channels fastest
        blocks = moved.shape[0] // len(assign)
        index = (np.arange(blocks)[:, None] * width + assign[None, :]).reshape(-1)
        out = np.zeros((blocks * width, *moved.shape[1:]), moved.dtype)
    else:
        index = assign
        out = np.zeros((width, *moved.shape[1:]), moved.dtype)
    out[index] = moved
    return np.moveaxis(out, 0, axis)


def patch_inputs(spec: perm_lib.PermutationSpec, variables: Variables, name: str,
                 assign: np.ndarray, width: int) -> Variables:
    """`variables` with every input axis fed by layer `name` widened to its global `width`
    by `assign` (the layer's own leaves are left to the caller)."""
    out = jax.tree_util.tree_map(np.asarray, variables)
    for path, axes in spec.axes.items():
        if path[1] == name:
            continue
        for axis, entry in enumerate(axes):
            target = entry.name if isinstance(entry, perm_lib.Flat) else entry
            if target == name:
                node = out
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = _place(node[path[-1]], axis, entry, assign, width)
    return out


def class_weighted_head(heads: Sequence[Dict[str, np.ndarray]], counts: np.ndarray
                        ) -> Dict[str, np.ndarray]:
    """The head averaged over clients, output c weighted by their counts of class c (a
    class no client holds: uniformly)."""
    counts = np.asarray(counts, np.float64)
    totals = counts.sum(0, keepdims=True)
    w = np.where(totals > 0, counts / np.where(totals > 0, totals, 1.0), 1.0 / len(heads))
    kernel = np.einsum("mc,mfc->fc", w, np.stack([h["kernel"] for h in heads]))
    bias = np.einsum("mc,mc->c", w, np.stack([h["bias"] for h in heads]))
    return {"kernel": kernel.astype(np.float32), "bias": bias.astype(np.float32)}


def check_model(model: nn.Module) -> None:
    """Raises ValueError unless FedMA can match `model` (MLP / VGG, no norm, no PANs)."""
    if not isinstance(model, (models.MLP, models.VGG)):
        raise ValueError(f"FedMA matches MLP and VGG networks, not {type(model).__name__}")
    if getattr(model, "grouped", None) is not None:
        raise ValueError("FedMA cannot match grouped (Fed2) networks")
    if model.norm != "none":
        raise ValueError(f"FedMA matches networks without normalisation (IBM's models have "
                         f"none); set model.norm='none', got {model.norm!r}")
    if model.pan is not None:
        raise ValueError("FedMA reorders neurons, which PANs pin to positions; set "
                         "pan.amplitude=0")


def network_for(model: nn.Module, variables: Variables) -> nn.Module:
    """`model` resized to the widths of `variables` (a FedMA global model's)."""
    return models.resized(model, {name: int(variables["params"][name]["kernel"].shape[-1])
                                  for name in models.widths(model)})


# ----------------------------------------------------------------------------------------
# The driver.
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class FedMA(RoundDefaults):
    """FedMA's server logic as an `engine.protocol.Round`, on the engine's `services`
    (sampling, key streams, cohorts trained through cached executors).

    `services.work` is the local training of step 1, `retrain` each retraining of step 2
    (None: no retraining, as one-shot matching).
    """

    model: nn.Module
    client_tx: optax.GradientTransformation
    services: Services
    retrain: Any = None  # engine.LocalWork or None
    sigma: float = 1.0
    sigma0: float = 1.0
    mu0_bias: float = 0.1
    gamma: float = 7.0
    iterations: int = 5
    cap: Optional[int] = 700  # IBM's cap on a layer's growth (None: none)
    own_init: bool = False  # round 0: each client from its own random initialisation
    # The retraining after the last hidden layer (only the head trains): its optimiser
    # and work (None: client_tx and `retrain`, as the others).
    head_tx: Optional[optax.GradientTransformation] = None
    head_retrain: Any = None

    # Checkpoints of a FedMA run hold networks whose widths grew: restore their shapes.
    shapes_change = True

    def __post_init__(self):
        check_model(self.model)
        self.num_sampled = self.services.num_sampled
        self.hidden = tuple(models.widths(self.model))

    def init(self, variables: Variables) -> SimState:
        return SimState(jax.tree_util.tree_map(np.asarray, dict(variables)), None, 0)

    def sample(self, round_index: int) -> np.ndarray:
        return self.services.sample(round_index)

    def evaluation(self, server: Variables) -> Tuple[nn.Module, Variables]:
        """The global network (its grown widths) and its variables."""
        return network_for(self.model, server), server

    def personal_evaluation(self, state: Any) -> None:
        """No personal models: clients are scored on the global one."""
        del state
        return None

    def personal_groups(self, state: Any) -> None:
        del state
        return None

    def _train(self, net: nn.Module, frozen: Tuple[str, ...], work: Any,
               states: List[Variables], ids: np.ndarray, round_index: int, stage: int,
               tx: Optional[optax.GradientTransformation] = None):
        """Every client's model trained by `work` (with `tx`, default `client_tx`) with
        `frozen` fixed: (models, metric sums, computed rows)."""
        tx = self.client_tx if tx is None else tx
        algorithm = local_training(net, tx, frozen)
        stacked = jax.tree_util.tree_map(lambda *x: jnp.asarray(np.stack(x)), *states)
        # Stage 0 orders batches as every other algorithm's local training does.
        cohort = self.services.cohort(ids, round_index, stacked, work=work, stage=stage)
        # One executor per network shape, frozen set, work and optimiser, reused.
        result = self.services.train((net, frozen, work, tx), algorithm, states[0], cohort,
                                     work=work)
        trained = jax.tree_util.tree_map(np.asarray, jax.device_get(result.client_states))
        out = [jax.tree_util.tree_map(lambda x: x[m], trained) for m in range(len(ids))]
        return out, jax.device_get(result.metrics), result.computed_examples

    def round(self, state) -> Tuple[Any, Dict[str, float]]:
        """Runs FedMA round `state.round`; returns the new state and the round's statistics."""
        r = state.round
        data = self.services.data
        ids = self.sample(r)
        m = len(ids)
        server = state.server
        net = network_for(self.model, server)
        down = m * tree_bytes(server)
        up = 0
        starts = [server] * m
        if r == 0 and self.own_init:  # IBM: every client's own random network
            shape = tuple(data.images.shape[1:])
            key = jax.random.fold_in(jax.random.PRNGKey(self.services.seed), OWN_INIT_STREAM)
            starts = [jax.tree_util.tree_map(np.asarray, models.init(
                net, jax.random.fold_in(key, int(k)), shape)) for k in ids]
            down = 0  # nothing is sent before the clients train
        clients, sums, computed = self._train(net, (), self.services.work, starts, ids, r, 0)
        real = self.services.real_examples(ids)
        stats = {"train_loss": float(sums["loss_sum"]) / max(float(sums["num_examples"]), 1)}
        retrain_loss = retrain_count = 0.0
        matched: Dict[str, Any] = {}
        for i, name in enumerate(self.hidden):
            spec = perm_lib.spec_for(net, clients[0])
            rows = [neuron_matrix(c["params"][name]) for c in clients]
            mu0 = np.zeros(rows[0].shape[1])
            mu0[-1] = self.mu0_bias
            match = matching.bbp_map(rows, sigma=self.sigma, sigma0=self.sigma0, mu0=mu0,
                                     gamma=self.gamma, iterations=self.iterations,
                                     rng=np.random.default_rng([self.services.seed, r, i]),
                                     cap=self.cap)
            width = len(match.weights)
            matched[name] = from_neuron_matrix(match.weights,
                                               clients[0]["params"][name]["kernel"].shape)
            up += sum(4 * x.size for x in rows)
            down += 4 * (m * match.weights.size + sum(len(a) for a in match.assignments))
            clients = [patch_inputs(spec, c, name, a, width)
                       for c, a in zip(clients, match.assignments)]
            for c in clients:
                c["params"][name] = dict(matched[name])
            net = models.resized(net, {name: width})
            if self.retrain is not None:
                last = i == len(self.hidden) - 1
                work = self.head_retrain if last and self.head_retrain is not None else (
                    self.retrain)
                clients, sums, rows_computed = self._train(
                    net, self.hidden[:i + 1], work, clients, ids, r, i + 1,
                    self.head_tx if last else None)
                retrain_loss += float(sums["loss_sum"])
                retrain_count += float(sums["num_examples"])
                computed += rows_computed
                real += self.services.real_examples(ids, work)
        heads = [c["params"]["head"] for c in clients]
        up += m * tree_bytes(heads[0])
        counts = np.asarray(data.label_counts)[ids]
        params = {**matched, "head": class_weighted_head(heads, counts)}
        if retrain_count:
            stats["train_retrain_loss"] = retrain_loss / retrain_count
        stats.update(real_examples=real, computed_examples=computed, upload_bytes=float(up),
                     download_bytes=float(down),
                     **{f"train_width_{k}": float(v["kernel"].shape[-1])
                        for k, v in matched.items()})
        return SimState({"params": params}, None, r + 1), stats


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                services: Services) -> FedMA:
    """The FedMA driver `cfg` describes (config.fedma, local), its clients training with
    `client_tx` on the engine's `services`."""
    work = services.work
    o = cfg.fedma
    epochs = work.epochs if o.retrain_epochs is None else o.retrain_epochs
    retrain = (None if epochs == 0 else
               LocalWork(work.batch_size, epochs, work.mode, work.local_steps, work.augment))
    opt = cfg.optimizer
    head_tx = head_retrain = None
    if o.head_retrain == "ibm" and retrain is not None:
        # IBM's main.py: the last retraining at lr / 10 with weight decay 1e-4, 3x epochs.
        head_tx = local_lib.client_optimizer(opt.lr / 10, opt.momentum, 1e-4, opt.grad_clip,
                                             opt.warmup, opt.warmup_length)
        head_retrain = dataclasses.replace(retrain, epochs=3 * epochs,
                                           local_steps=None if retrain.local_steps is None
                                           else 3 * retrain.local_steps)
    return FedMA(model, client_tx, services, retrain, o.sigma, o.sigma0, o.mu0_bias, o.gamma,
                 int(o.iterations), int(o.width_cap) or None,
                 bool(o.own_init), head_tx, head_retrain)


def _no_round(model, cfg, client_tx, server_tx):
    raise ValueError("FedMA runs through its driver (`from_config`), not as one compiled "
                     "federated round")


ENTRY = AlgorithmEntry(_no_round, OPTIONS, RULES, driver=from_config, reference=REFERENCE)
