"""FedKD (Wu, Wu, Lyu, Qi, Huang, Xie, "Communication-efficient federated learning via
knowledge distillation", Nature Communications 13, 2032, 2022).

Every client keeps a private teacher T (its own network, possibly of another
architecture than other clients') and trains it with its copy of the shared student S
(one architecture for every client) by adaptive mutual distillation on each batch:

    L_t = CE(y_t, y) + [KL(y_s || y_t) + MSE(H_t, W_h H_s)] / (CE(y_t, y) + CE(y_s, y))
    L_s = CE(y_s, y) + [KL(y_t || y_s) + MSE(H_t, W_h H_s)] / (CE(y_t, y) + CE(y_s, y))

y the softmax outputs, H the hidden states (each network's input to its head), W_h a
private linear map (no bias) from the student's width to the teacher's. Distillation
weighs less where the two predict badly. The student's update g = S_after - S_broadcast is
compressed by SVD before upload: each matrix g = U diag(sigma) V^T keeps its k largest
singular values, k the fewest whose energy sum_{i<k} sigma_i^2 exceeds T(r) times the
total, where T(r) = T_start + r / R (T_end - T_start) grows over the R rounds. The server
averages the clients' reconstructed updates (FedAvg on the student; `server_tx`, sgd(1.0)
is the plain average). A client is scored on its teacher (as PFLlib evaluates).

Choices that follow PFLlib's clientkd.py / serverkd.py:
- KL is PyTorch's `nn.KLDivLoss()` ('mean' over the B x C elements; `kl_mean='examples'`:
  per example) and MSE `nn.MSELoss()` (the mean over the B x D_t elements);
- the denominators and targets are not detached (`detach=False`): PFLlib backpropagates
  L_t and L_s into the teacher, the student and W_h, so each step follows the gradient of
  L_t + L_s; `detach=True` makes each loss see the other network's outputs, hidden states
  and cross-entropy as constants (W_h still learns from both);
- each of the three gradients is clipped to norm `clip` (PFLlib's `clip_grad_norm_(...,
  10)`) before its optimiser; the teacher and W_h train with the client optimiser, the
  student with it at learning rate `mentee_lr` (PFLlib's `-mlr`, 0.005: the client
  optimiser's steps scaled by mentee_lr / optimizer.lr), each with its own state,
  fresh every round (PFLlib's plain SGD keeps none);
- the energy schedule: round r (from 0) uses T_start + r / R (T_end - T_start), PFLlib's
  server energy (0.95 -> 0.98); a matrix whose singular values are all 0 goes uncompressed.
Deviations, each for a reason:
- the student is the option `fedkd.student`, a model spec, default 'mlp(hidden=(200,))'
  (PFLlib's student and teacher are both copies of the global model; heterogeneous
  teachers need a student of its own architecture), so W_h maps D_s to D_t (PFLlib's is
  square);
- the update is compressed, not the student's parameters (the paper's gradients; PFLlib
  factorises the whole model), and the download is the uncompressed student (PFLlib
  factorises the global model, the paper the global update: a client sampled now may have
  missed earlier updates, and truncating the model itself every round loses what the
  truncation drops); `download_bytes` counts it;
- where even all singular values fall short of T(r) (energy 1, or float rounding) the
  matrix keeps all of them (PFLlib's loop leaves k = 0 there and zeroes the matrix); a
  matrix goes dense where its factors would be larger (PFLlib always factorises);
- matrices are the kernels with ndim >= 2 reshaped to (prod(shape[:-1]), out) (a conv as
  its (kh kw in) x out matrix; PFLlib's numpy SVD of a 4-D conv weight factorises each
  kh x kw kernel slice, which does not shrink a 3x3 kernel); vectors go dense;
- the denominator is kept >= 1e-8 (a batch of padding only has no loss; PFLlib divides
  by 0 there).
A client's upload, the factors (k (m + n + 1) float32 per factorised matrix), the dense
leaves and the student's non-trainable state, is counted in its output's `upload_bytes`
(the aggregate of that entry is unused). SVD runs on every client inside the compiled
round (vmapped: batched over clients).

The student starts from `models.init` with PRNGKey(seed) folded with STUDENT_KEY, W_h
from PyTorch's Linear initialisation U(-1/sqrt(D_s), 1/sqrt(D_s)) on PRNGKey(seed) folded
with WH_KEY (every client alike: the state of a client that never trained); teachers from
their network's initial model. The global evaluation shows this network's initial model
(the student is another network).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan import models
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm,
                                        federated_algorithm, sends, tree_bytes)
from fedjax_pan.algorithms.fedavg_family.fedavg import server_step
from fedjax_pan.algorithms.personal.fml import (DEFAULT_SPEC, KL_MEANS, clipped_step, head_classes,
                                       kl_divergence, shared_network, spec_error)
from fedjax_pan.algorithms.personal import HEAD
from fedjax_pan.references import Reference, pfllib
from fedjax_pan.rules import Rule, between, boolean, check_options, one_of

PyTree = Any
OPTIONS = {"student": DEFAULT_SPEC, "mentee_lr": 0.005, "t_start": 0.95, "t_end": 0.98,
           "detach": False, "kl_mean": "elements", "clip": 10.0}
RULES = {"student": Rule(spec_error), "mentee_lr": between(0, 100, lo_open=True),
         "t_start": between(0, 1, lo_open=True), "t_end": between(0, 1, lo_open=True),
         "detach": Rule(boolean), "kl_mean": one_of(KL_MEANS), "clip": between(0, 1e6)}
STUDENT_KEY, WH_KEY = 0x5D5D, 0x3A3A  # folded into the seed
MIN_DENOMINATOR = 1e-8


REFERENCE = Reference(
    "Wu et al., 'Communication-efficient federated learning via knowledge distillation', "
    "Nature Communications 13, 2032, 2022 (FedKD: adaptive mutual distillation L_t, L_s "
    "with hidden-state loss, and SVD compression of the update at the energy T(r))",
    pfllib("servers/serverkd.py", "clients/clientkd.py"),
    ("the student is the option fedkd.student (default mlp(hidden=(200,))), so W_h maps "
     "D_s to D_t; PFLlib's student and teacher are copies of the global model (W_h square)",
     "the student's update is compressed (the paper's gradients) and the download is the "
     "uncompressed student; PFLlib factorises the whole student model and the global model",
     "where no prefix of singular values exceeds T(r) a matrix keeps them all (PFLlib's "
     "loop leaves k = 0 and zeroes it); a matrix goes dense where its factors would be "
     "larger (PFLlib always factorises)",
     "a conv kernel is factorised as its (kh kw in) x out matrix; PFLlib's numpy SVD of a "
     "4-D weight factorises each kh x kw slice",
     "the denominator CE_t + CE_s is kept >= 1e-8 (PFLlib divides by 0 on a batch of "
     "padding only)",
     "the server averages with the configured aggregation weights (PFLlib's uniform 1/M is "
     "aggregation.weights='uniform', the default) and averages the student's BatchNorm "
     "statistics (PFLlib shares parameters only)"))


def energy(round_index: jax.Array, rounds: int, t_start: float, t_end: float) -> jax.Array:
    """T(r) = T_start + r / R (T_end - T_start): the energy round r's factors keep."""
    r = jnp.asarray(round_index, jnp.float32)
    return t_start + r / max(int(rounds), 1) * (t_end - t_start)


def svd_compress(x: jax.Array, keep_energy: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """(what the receiver reconstructs, the bytes sent) for one leaf: a matrix (ndim >= 2,
    as (prod(shape[:-1]), out), both > 1) keeps its k leading singular triplets, k the
    fewest whose energy exceeds `keep_energy` of the total (all where none do); dense where
    that is no smaller, or all its singular values are 0; other leaves dense."""
    item = np.dtype(x.dtype).itemsize
    if x.ndim < 2 or min(int(np.prod(x.shape[:-1])), x.shape[-1]) < 2:
        return x, jnp.float32(x.size * item)
    rows, cols = int(np.prod(x.shape[:-1])), int(x.shape[-1])
    m = x.reshape(rows, cols).astype(jnp.float32)
    u, s, vt = jnp.linalg.svd(m, full_matrices=False)
    power = s * s
    total = jnp.sum(power)
    short = jnp.sum(jnp.cumsum(power) <= keep_energy * total)  # prefixes not enough
    k = jnp.minimum(short + 1, s.shape[0])
    approx = (u * jnp.where(jnp.arange(s.shape[0]) < k, s, 0.0)) @ vt
    factored = k * (rows + cols + 1)
    dense = (total == 0) | (factored >= rows * cols)
    approx = jnp.where(dense, m, approx)
    sent = jnp.where(dense, rows * cols, factored).astype(jnp.float32) * item
    return approx.reshape(x.shape).astype(x.dtype), sent


def compress_tree(tree: PyTree, keep_energy: jax.Array) -> Tuple[PyTree, jax.Array]:
    """`svd_compress` on every leaf: (the reconstructed tree, the bytes sent)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    pairs = [svd_compress(x, keep_energy) for x in leaves]
    return (jax.tree_util.tree_unflatten(treedef, [a for a, _ in pairs]),
            sum((b for _, b in pairs), jnp.float32(0)))


class KdServer(NamedTuple):
    params: PyTree  # this network's initial model (the global evaluation's)
    model_state: PyTree
    student: PyTree  # the student's parameters
    student_state: Dict[str, PyTree]  # its non-trainable collections (BatchNorm)
    opt_state: PyTree  # server_tx's, on the student
    w_h: jax.Array  # (D_s, D_t): every client's W_h before it trains
    round: jax.Array


class KdLocal(NamedTuple):
    teacher: local_lib.LocalState
    student: local_lib.LocalState
    w_h: local_lib.LocalState  # params: the (D_s, D_t) kernel


def _width(params: PyTree, who: str) -> int:
    head_classes(params, who)
    return int(params[HEAD]["kernel"].shape[0])


def fedkd(model: nn.Module, client_tx: optax.GradientTransformation,
          server_tx: optax.GradientTransformation = optax.sgd(1.0), *,
          input_shape: Tuple[int, ...], rounds: int,
          student_tx: Optional[optax.GradientTransformation] = None,
          student: str = DEFAULT_SPEC, t_start: float = 0.95, t_end: float = 0.98,
          detach: bool = False, kl_mean: str = "elements", clip: float = 10.0,
          seed: int = 0) -> FederatedAlgorithm:
    """FedKD for a teacher network `model` that sows its 'features' and the student the
    spec `student` describes, initialised for inputs of `input_shape` from `seed`;
    `student_tx` trains the student (None: `client_tx`); the energy rises from `t_start`
    to `t_end` over `rounds` rounds."""
    check_options(RULES, "fedkd", student=student, t_start=t_start, t_end=t_end,
                  detach=detach, kl_mean=kl_mean, clip=clip)
    if not (isinstance(rounds, (int, np.integer)) and rounds >= 1):
        raise ValueError(f"FedKD needs rounds >= 1, got {rounds!r}")
    input_shape = tuple(input_shape)
    student_tx = client_tx if student_tx is None else student_tx
    teacher_net = local_lib.WithFeatures(model)
    other = jax.lax.stop_gradient if detach else (lambda x: x)

    def student_net(params):
        return local_lib.WithFeatures(shared_network(student,
                                                     head_classes(params, "FedKD's student")))

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        net = shared_network(student, head_classes(params, "FedKD"))
        key = jax.random.PRNGKey(seed)
        s_params, s_state = local_lib.split_variables(
            models.init(net, jax.random.fold_in(key, STUDENT_KEY), input_shape))
        d_s, d_t = _width(s_params, "FedKD's student"), _width(params, "FedKD")
        bound = 1.0 / np.sqrt(d_s)
        w_h = jax.random.uniform(jax.random.fold_in(key, WH_KEY), (d_s, d_t), jnp.float32,
                                 -bound, bound)
        return KdServer(params, model_state, s_params, s_state, server_tx.init(s_params),
                        w_h, jnp.zeros((), jnp.int32))

    def client_state_init(server):
        return {"teacher": {"params": server.params, **server.model_state},
                "w_h": server.w_h}

    def client_init(server, client_state, ctx):
        return KdLocal(
            local_lib.init_local(client_tx, client_state["teacher"], ctx.round),
            local_lib.init_local(student_tx, {"params": server.student,
                                              **server.student_state}, ctx.round),
            local_lib.init_local(client_tx, {"params": client_state["w_h"]}, ctx.round))

    def client_step(local, batch, server):
        del server  # the broadcast student is in the local state
        net = student_net(local.student.params)
        mask = batch["mask"]
        n = jnp.maximum(jnp.sum(mask), 1.0)

        def objective(params):
            wt, ws, w_h = params
            (out_t, h_t), state_t = local_lib.forward(teacher_net, wt,
                                                      local.teacher.model_state, batch, True)
            (out_s, h_s), state_s = local_lib.forward(net, ws, local.student.model_state,
                                                      batch, True)
            h_t = h_t.reshape(h_t.shape[0], -1).astype(jnp.float32)
            h_s = h_s.reshape(h_s.shape[0], -1).astype(jnp.float32)
            ce_t_sum = local_lib.masked_cross_entropy(out_t, batch["y"], mask)
            ce_s_sum = local_lib.masked_cross_entropy(out_s, batch["y"], mask)
            ce_t, ce_s = ce_t_sum / n, ce_s_sum / n
            kl_t, kl_sum = kl_divergence(other(out_s), out_t, mask, kl_mean)
            kl_s, _ = kl_divergence(other(out_t), out_s, mask, kl_mean)

            def mse(a, b):
                return jnp.sum(mask[:, None] * (a - b) ** 2) / (n * a.shape[-1])
            hidden_t = mse(h_t, other(h_s) @ w_h)
            hidden_s = mse(other(h_t), h_s @ w_h)
            den_t = jnp.maximum(ce_t + other(ce_s), MIN_DENOMINATOR)
            den_s = jnp.maximum(other(ce_t) + ce_s, MIN_DENOMINATOR)
            loss_t = ce_t + (kl_t + hidden_t) / den_t
            loss_s = ce_s + (kl_s + hidden_s) / den_s
            return loss_t + loss_s, (state_t, state_s, ce_t_sum, ce_s_sum, kl_sum,
                                     hidden_t * n)

        grads, (state_t, state_s, ce_t, ce_s, kl_sum, hidden_sum) = jax.grad(
            objective, has_aux=True)((local.teacher.params, local.student.params,
                                      local.w_h.params))

        new = KdLocal(clipped_step(client_tx, local.teacher, grads[0], state_t, clip),
                      clipped_step(student_tx, local.student, grads[1], state_s, clip),
                      clipped_step(client_tx, local.w_h, grads[2], {}, clip))
        return new, {"loss_sum": ce_t, "num_examples": jnp.sum(mask),
                     "student_loss_sum": ce_s, "kl_sum": kl_sum, "hidden_sum": hidden_sum}

    def client_output(local, server):
        delta = jax.tree_util.tree_map(jnp.subtract, local.student.params, server.student)
        sent, sent_bytes = compress_tree(delta, energy(server.round, rounds, t_start, t_end))
        state = local.student.model_state
        return ({"delta": sent, "model_state": state,
                 "upload_bytes": sent_bytes + tree_bytes(state)},
                {"teacher": local_lib.model_variables(local.teacher), "w_h": local.w_h.params})

    def server_update(server, mean, info):
        del info
        student, opt_state = server_step(server_tx, server.student, server.opt_state,
                                         mean["delta"])
        return server._replace(student=student, student_state=mean["model_state"],
                               opt_state=opt_state, round=server.round + 1)

    def personal_variables(server, client_state):
        del server
        return client_state["teacher"]

    def upload_bytes(output, local):
        del local
        return output["upload_bytes"]

    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=client_state_init,
                               upload_bytes=upload_bytes, personal_variables=personal_variables,
                               download_bytes=sends("student", "student_state"))


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation, *, input_shape: Tuple[int, ...]
                ) -> FederatedAlgorithm:
    o = cfg.fedkd
    # The student's optimiser: the client optimiser's steps at mentee_lr instead of lr.
    student_tx = optax.chain(client_tx, optax.scale(o.mentee_lr / cfg.optimizer.lr))
    return fedkd(model, client_tx, server_tx, input_shape=input_shape, rounds=cfg.rounds,
                 student_tx=student_tx, student=o.student, t_start=o.t_start,
                 t_end=o.t_end, detach=o.detach, kl_mean=o.kl_mean, clip=o.clip,
                 seed=cfg.seed)


ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, personal=True, heterogeneous=True,
                       input_shape=True, reference=REFERENCE)
