"""Fed2 feature paired averaging (Yu et al., paper 003 Eq. 18-19) and Psi-Net trimming
(paper 004 Eq. 6-9), on a grouped model (`fedjax_pan.models.grouped`).

    shared layers:   Omega_shared = sum_k w_k delta_k / sum_k w_k                (FedAvg)
    group g:         Omega_g      = sum_k w_k v_kg delta_kg / sum_k w_k v_kg
    v_kg = n_k,g (the client's samples of group g's classes; 'class_samples', the default)
         = 1[n_k,g > 0] ('presence': 004 Eq. 8, a plain mean over the clients holding it)

w_k is the engine's aggregation weight (uniform by default, as the PAN paper), so with
uniform weights group g is averaged in proportion to the clients' samples of its classes.
'class_samples' with `aggregation.weights = "num_examples"` would weight client k's group g
by n_k x n_k,g, its samples counted twice: the config check refuses that pair.
A group no sampled client holds gets no update and keeps its previous value; GroupNorm
scale/shift travel with their group. With `trim` (Psi-Net's extreme non-IID rule, 004
Eq. 6) a client drops the groups whose classes it lacks: their logits leave its softmax, so
they neither shape its training nor are sent (`upload_bytes` counts what is).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan import models
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (Aggregator, AlgorithmEntry, FederatedAlgorithm,
                                        tree_bytes)
from fedjax_pan.algorithms.fedavg_family.fedavg import fedavg
from fedjax_pan.references import Reference
from fedjax_pan.rules import Rule, boolean, check_options, one_of

PyTree = Any
GROUP_WEIGHTS = ("class_samples", "presence")
OPTIONS = {"group_weights": "class_samples", "trim": False}
RULES = {"group_weights": one_of(GROUP_WEIGHTS),
         "trim": Rule(boolean)}

REFERENCE = Reference(
    "Yu et al., 'Fed2: Feature-Aligned Federated Learning', KDD 2021 (paper 003: feature "
    "paired averaging, Eq. 18-19); Yu et al., 'Heterogeneous Federated Learning', arXiv "
    "2020 (Psi-Net, "
    "paper 004: trimmed groups Eq. 6, group-wise averaging Eq. 7-9)", None,
    ("the default group_weights='class_samples' weights client k's group g by its samples "
     "of g's classes; the papers' Avg over the clients holding the class (004 Eq. 8) is "
     "group_weights='presence'",
     "the server averages the clients' deltas and applies them with FedAvg's server step; "
     "a group no sampled client holds keeps its previous value",
     "the decoupling depth and G are the grouped model's configuration "
     "(fedjax_pan.models.grouped), not chosen by 003 Eq. 17's total variance",
     "GroupNorm scale/shift travel with their group; BatchNorm statistics of shared layers "
     "follow FedAvg's bn mode"))


class Local(NamedTuple):
    """A client's working state: local training plus its group sample counts (G,)."""

    train: local_lib.LocalState
    group_counts: jax.Array


def group_counts(label_counts: jax.Array, class_map: np.ndarray, groups: int) -> jax.Array:
    """(C,) label histogram -> (G,) samples per group."""
    onehot = jnp.asarray(np.arange(groups)[:, None] == class_map[None, :], jnp.float32)
    return onehot @ label_counts.astype(jnp.float32)


def owned_mask(owners, path, shape, per_group: jax.Array):
    """per_group (G,) broadcast onto a grouped leaf along its group axis."""
    axis, owner = owners[path]
    return per_group[jnp.asarray(owner)].reshape((-1,) + (1,) * (len(shape) - axis - 1))


def suggested_grouping(model: nn.Module) -> Optional[Dict[str, int]]:
    """Fed2's grouping that fits an ungrouped `model`: {'groups': G, 'depth': D}, or None
    where it has no grouped form or too few weight layers.

    The paper's G = 10 and D = 6 (VGG-9), with D kept below the model's weight-layer count
    (at least one shared layer where there are three or more) and G at most the classes
    (each group owns a class) and the narrowest grouped hidden width (grouped widths round
    up to a multiple of G: a narrower layer would grow to G units).
    """
    if not hasattr(model, "grouped") or not hasattr(model, "weight_layers"):
        return None
    names = tuple(model.weight_layers())
    if len(names) < 2:
        return None
    depth = max(2, min(6, len(names) - 1))
    grouped = names[-depth:-1]  # the grouped hidden layers (the head's width is C)
    # Widths from the kernels' output axes; an MLP's, VGG's or MobileNet's do not depend
    # on the input's shape, so a CIFAR-sized one serves every dataset.
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               jnp.zeros((1, 32, 32, 3)), train=False))
    widths = [int(leaf.shape[-1]) for path, leaf in
              jax.tree_util.tree_flatten_with_path(shapes["params"])[0]
              if path[-1].key == "kernel" and any(
                  path[0].key == n or path[0].key.startswith(n + "_") for n in grouped)]
    groups = max(1, min([10, int(model.num_classes)] + widths))
    return {"groups": groups, "depth": depth}


def _needs_grouping(model: nn.Module) -> str:
    """The refusal of an ungrouped model, with the grouping that runs on it."""
    fix = suggested_grouping(model)
    if fix is None:
        n = len(model.weight_layers()) if hasattr(model, "weight_layers") else 0
        why = (f"{type(model).__name__} has no grouped form" if not hasattr(model, "grouped")
               else f"this {type(model).__name__} has {n} weight layer(s) and Fed2 groups at "
                    f"least 2 (a hidden layer and the head)")
        return (f"fed2 needs a grouped model, and {why}: use model mlp, cnn, vgg* or "
                f"mobilenet with model.options.grouped (configs/cifar10_fed2.py)")
    n = len(model.weight_layers())
    return (f"fed2 needs a grouped model: set --config.model.options.grouped=\""
            f"{{'groups': {fix['groups']}, 'depth': {fix['depth']}}}\" (G = {fix['groups']} "
            f"groups over the last D = {fix['depth']} of this {type(model).__name__}'s {n} "
            f"weight layers; the paper: G = 10, D = 6 on VGG-9), or use "
            f"configs/cifar10_fed2.py")


def _map_grouped(fn_grouped, fn_shared, owners, params: PyTree) -> PyTree:
    """fn_grouped(path, leaf) on grouped leaves of a params tree, fn_shared(leaf) elsewhere."""
    def one(path, leaf):
        key = ("params",) + tuple(k.key for k in path)
        return fn_grouped(key, leaf) if key in owners else fn_shared(leaf)
    return jax.tree_util.tree_map_with_path(one, params)


def fed2(model: nn.Module, client_tx: optax.GradientTransformation,
         server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
         group_weights: str = "class_samples", trim: bool = False) -> FederatedAlgorithm:
    """Fed2 (or, with trim=True, Psi-Net) for a grouped flax `model`."""
    gc = getattr(model, "grouped", None)
    if gc is None:
        raise ValueError(_needs_grouping(model))
    check_options(RULES, "fed2", group_weights=group_weights, trim=trim)
    groups = int(gc.groups)
    class_map = gc.class_map(model.num_classes)
    owners_of = lambda params: models.group_owners(model, {"params": params})  # noqa: E731

    def client_init(server, client_state, ctx):
        del client_state
        train = local_lib.init_local(client_tx, {"params": server.params,
                                                 **server.model_state}, server.round)
        return Local(train, group_counts(ctx.label_counts, class_map, groups))

    def client_step(local, batch, server):
        del server
        kept = (local.group_counts > 0)[jnp.asarray(class_map)]  # (C,) classes kept

        def trimmed(logits, labels, mask):  # trimmed classes leave the softmax
            logits = jnp.where(kept, logits, jnp.finfo(logits.dtype).min)
            return local_lib.masked_cross_entropy(logits, labels, mask)
        train, metrics = local_lib.sgd_step(
            model, client_tx, local.train, batch,
            loss=trimmed if trim else local_lib.masked_cross_entropy)
        return Local(train, local.group_counts), metrics

    def sent_groups(local):
        return local.group_counts > 0 if trim else jnp.ones((groups,), bool)

    def client_output(local, server):
        v = local.group_counts
        if group_weights == "presence":
            v = (v > 0).astype(jnp.float32)
        owners = owners_of(server.params)
        delta = jax.tree_util.tree_map(jnp.subtract, local.train.params, server.params)
        # Numerators: each grouped entry weighted by its group's v_kg (0 for groups the
        # client lacks, so nothing of a trimmed group reaches the server).
        num = _map_grouped(lambda p, d: d * owned_mask(owners, p, d.shape, v).astype(d.dtype),
                           lambda d: d, owners, delta)
        return {"delta": num, "group_weight": v, "model_state": local.train.model_state}, None

    def upload_bytes(output, local):
        owners = owners_of(output["delta"])
        sent = sent_groups(local).astype(jnp.float32)

        def nbytes(path, leaf):
            size = tree_bytes(leaf) / leaf.shape[owners[path][0]]
            return jnp.sum(sent[jnp.asarray(owners[path][1])]) * size
        sizes = _map_grouped(nbytes, tree_bytes, owners, output["delta"])
        rest = tree_bytes((output["group_weight"], output["model_state"]))
        return sum(jax.tree_util.tree_leaves(sizes)) + rest

    def finalize(output_sum, total_weight):
        owners = owners_of(output_sum["delta"])
        den = output_sum["group_weight"]  # (G,) sum_k w_k v_kg

        def grouped(path, num):
            d = owned_mask(owners, path, num.shape, den)
            return jnp.where(d > 0, num / jnp.where(d > 0, d, 1.0).astype(num.dtype), 0.0)
        delta = _map_grouped(grouped, lambda x: x / total_weight.astype(x.dtype), owners,
                             output_sum["delta"])
        model_state = jax.tree_util.tree_map(lambda x: x / total_weight.astype(x.dtype),
                                             output_sum["model_state"])
        return {"delta": delta, "model_state": model_state}

    # Server state, update and evaluation are FedAvg's: `finalize` hands its server update
    # the mean delta it expects, averaged group by group.
    base = fedavg(model, client_tx, server_tx)
    return base._replace(client_init=client_init, client_step=client_step,
                         client_output=client_output, aggregator=Aggregator(finalize),
                         upload_bytes=upload_bytes, model_view=None)

def _check(cfg: Any) -> None:
    if cfg.fed2.group_weights == "class_samples" and cfg.aggregation.weights != "uniform":
        raise ValueError(
            f"fed2.group_weights='class_samples' weights client k's group g by its samples "
            f"n_kg already; with aggregation.weights={cfg.aggregation.weights!r} (w_k = n_k) "
            f"they would count twice (n_k x n_kg): set aggregation.weights='uniform' (Fed2's "
            f"Eq. 18) or fed2.group_weights='presence'")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation) -> FederatedAlgorithm:
    return fed2(model, client_tx, server_tx, group_weights=cfg.fed2.group_weights,
                trim=cfg.fed2.trim)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, check=_check, reference=REFERENCE)
