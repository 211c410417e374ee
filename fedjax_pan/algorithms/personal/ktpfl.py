"""KT-pFL (Zhang et al., NeurIPS 2021; paper 001's Algorithm 1): personalised models that
share knowledge through soft predictions on unlabelled public data.

Every client n keeps its own model w^n (nothing is averaged). A round, in the paper's order
(`ktpfl.order = "paper"`, the default): (1) each sampled client trains on its private
data; (2) it sends its soft predictions s(w^n, x) = softmax(z / T) on the whole public
set; (3) the server stores them, takes one gradient step on c (Eq. 7) and forms each
client's personalised target sum_m c_mn s^m from this round's predictions; (4) the client
distils on public batches towards its target, minimising T^2 KL(target || s(w^n, x))
(Hinton's T^2 keeps the gradient's scale across T). The step on c:

    c <- c - eta3 grad_c [ lam sum_n (D_n / D) KL(sum_m c_mn s^m || s^n)
                           + rho ||c - 1/N||^2 ]

KL averaged over the public examples. With a server step between two client phases the
round is no one compiled function: `KtMixed` runs it as a driver on the engine's services
(phase 2 starts from the phase-1 model with a fresh optimiser, on a batch order of its own).
`order = "lagged"` is one compiled round (`ktpfl`): a client trains, distils towards targets
mixed from the predictions the server holds, sent at the end of the previous round (after
that round's distillation), then sends its distilled model's predictions and the server
steps c: the targets lag a round.

The paper constrains c no further than the regulariser pulling it to 1/N; unconstrained,
the steps shrink the columns' sums (a target is then no distribution) and drive entries
negative, where the target's log turns NaN (Fashion-MNIST, 20 clients, the 2NN, the
default eta3 = 0.1: column sums down to 0.39 by round 7, an entry negative in round 8, c
NaN from round 9, the training loss NaN in round 11). So by default (`simplex=True`) each
column of c is projected onto the probability simplex after every step (Euclidean
projection) and every target stays a mixture of the clients' predictions; `simplex=False`
is the paper's unconstrained step.
`coef_update = "authors"` steps c as the authors' released code does instead
(`authors_coefficients`: each client's column by the gradient of the MSE between its soft
predictions and its target plus rho x the MSE to 1/N, at a rate rescaled by the gradient's
size, then replaced by the softmax of 5 x itself).
Before any client has trained, every client's soft predictions are the initial model's.

Here the distillation is the last `distill_share` of the round's local steps (so it comes
out of `local.epochs`: E = 2 with `ktpfl.distill_epochs` = 1 trains one epoch, then
distils for as many steps), each on a public batch of the local batch size drawn with
replacement from the client's key. Clients evaluate their own w^n; there is no global
model (the global evaluation shows the initial one).

Clients may differ in architecture (`config.ktpfl.architectures`, model specs separated by
';', client n taking spec n mod A as PFLlib's heterogeneous-model clients do): `KtMixed`
groups clients by architecture, runs each group through executors of its own, and
steps the shared c and soft predictions once per round (`absorb`), in either order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_pan import models
from fedjax_pan.algorithms import local as local_lib
from fedjax_pan.algorithms.core import (AlgorithmEntry, FederatedAlgorithm, RoundInfo,
                                        every_output, federated_algorithm, own_model,
                                        server_model, weighted_sum)
from fedjax_pan.engine.services import RoundDefaults, Services, SimState
from fedjax_pan.references import Reference
from fedjax_pan.rules import Rule, between, boolean, one_of

PyTree = Any


_spec_texts = models.spec_texts


def parse_architectures(text: str) -> List[Tuple[str, Dict[str, Any]]]:
    """The model specs (`models.parse_spec`) of `text`, separated by ';' ('': none)."""
    return [models.parse_spec(s) for s in _spec_texts(text)]


COEF_UPDATES = ("kl", "authors")  # Eq. 7's step on the KL objective, or the released code's
ORDERS = ("paper", "lagged")  # a round's order (module docstring)
PHASES = ("both", "train", "distill")  # `ktpfl`'s client work: a lagged round, or one phase
OPTIONS = {"temperature": 1.0, "lam": 1.0, "rho": 0.1, "coef_lr": 0.1, "distill_epochs": 1.0,
           "simplex": True, "coef_update": "kl", "architectures": "", "order": "paper"}
# Logits are divided by the temperature in float32: >= 0.01 keeps them far from overflow.
RULES = {"temperature": between(0.01, 100), "lam": between(0, 1e4), "rho": between(0, 1e4),
         "coef_lr": between(0, 100), "distill_epochs": between(0, 1000, lo_open=True),
         "simplex": Rule(boolean), "coef_update": one_of(COEF_UPDATES),
         "architectures": Rule(models.specs_error), "order": one_of(ORDERS)}
EPS = 1e-12  # inside logs of probabilities

REFERENCE = Reference(
    "Zhang et al., 'Parameterized Knowledge Transfer for Personalized Federated Learning', "
    "NeurIPS 2021 (KT-pFL, Alg. 1; Eq. 7's step on the knowledge coefficient matrix c)",
    None,
    ("each column of c is projected onto the probability simplex after every step "
     "(simplex=True, the default): the paper's unconstrained step (simplex=False) drives "
     "entries negative and the targets' logs NaN",
     "coef_update='authors' steps c as the authors' released code does (MSE gradient, "
     "rescaled rate, softmax of 5 c), as the module docstring says; that code is not "
     "pinned here. The default 'kl' is Eq. 7",
     "the distillation is the last distill_share of the round's local steps (out of "
     "local.epochs), each on a public batch drawn with replacement; the distillation loss "
     "is T^2 KL(target || s(w, x))",
     "order='lagged' (not the default) mixes targets from the previous round's predictions, "
     "so that a round is one compiled function"))
PUBLIC_SIZE = 1000  # unlabelled public examples held out by default


class KtServer(NamedTuple):
    params: PyTree  # the initial model (evaluated as the "global" one)
    model_state: Dict[str, PyTree]
    coef: jax.Array  # c (N, N): c[m, n] = client m's share in client n's target
    soft: jax.Array  # (N, P, C): every client's latest soft predictions on the public set
    sizes: jax.Array  # (N,) D_n as the clients reported them (0: never took part, no weight)
    round: jax.Array


class KtLocal(NamedTuple):
    train: local_lib.LocalState
    target: jax.Array  # (P, C) this client's personalised soft target
    key: jax.Array
    distill_from: jax.Array  # the first distillation step
    size: jax.Array  # D_n, reported with the soft predictions


def soft_predictions(logits: jax.Array, temperature: float) -> jax.Array:
    return jax.nn.softmax(logits / temperature, axis=-1)


def kl_rows(target: jax.Array, probs: jax.Array) -> jax.Array:
    """KL(target || probs) of each row, summed over the last (class) axis."""
    return jnp.sum(target * (jnp.log(target + EPS) - jnp.log(probs + EPS)), axis=-1)


def kl(target: jax.Array, probs: jax.Array) -> jax.Array:
    """KL(target || probs) averaged over every row."""
    return jnp.mean(kl_rows(target, probs))


def targets(coef: jax.Array, soft: jax.Array) -> jax.Array:
    """(N, P, C): client n's target sum_m c[m, n] soft[m]."""
    return jnp.einsum("mn,mpc->npc", coef, soft)


def coefficient_objective(coef: jax.Array, soft: jax.Array, weights: jax.Array, lam: float,
                          rho: float) -> jax.Array:
    """lam sum_n w_n KL(target_n || soft_n) + rho ||c - 1/N||^2 (w: D_n / D)."""
    t = targets(coef, soft)
    per_client = jax.vmap(kl)(t, soft)
    n = coef.shape[0]
    return lam * jnp.sum(weights * per_client) + rho * jnp.sum((coef - 1.0 / n) ** 2)


def update_coefficients(coef: jax.Array, soft: jax.Array, sizes: jax.Array, lam: float,
                        rho: float, lr: float) -> jax.Array:
    """One gradient step of size `lr` on `coefficient_objective` (Eq. 7)."""
    weights = sizes / jnp.maximum(jnp.sum(sizes), 1.0)
    grad = jax.grad(coefficient_objective)(coef, soft, weights, lam, rho)
    return coef - lr * grad


def simplex_columns(coef: jax.Array) -> jax.Array:
    """Each column of `coef` projected onto the probability simplex (the nearest
    non-negative column summing to 1 in Euclidean distance; Duchi et al. 2008)."""
    n = coef.shape[0]

    def project(v):
        u = jnp.sort(v)[::-1]
        css = jnp.cumsum(u)
        k = jnp.arange(1, n + 1, dtype=v.dtype)
        last = jnp.max(jnp.where(u - (css - 1.0) / k > 0, jnp.arange(n), 0))
        return jnp.maximum(v - (css[last] - 1.0) / (last + 1.0), 0.0)
    return jax.vmap(project, in_axes=1, out_axes=1)(coef)


def authors_coefficients(coef: jax.Array, soft: jax.Array, rho: float) -> jax.Array:
    """The authors' step on c (their `get_models_logits`): for each client n, the gradient
    g of MSE(s_n, sum_m c[m, n] s_m) + rho MSE(c[:, n], 1/N) in c[:, n] (means over the
    entries), a rate that starts at 1 and, five times over, is divided by 5 while
    sum |g| / N (rescaled with it) exceeds 0.01 and multiplied by 5 while it is below, then
    the column replaced by softmax(5 (c[:, n] - rate g))."""
    n = coef.shape[0]

    def loss(column, own):
        target = jnp.einsum("m,mpc->pc", column, soft)
        return jnp.mean((own - target) ** 2) + rho * jnp.mean((column - 1.0 / n) ** 2)

    def step(column, own):
        g = jax.grad(loss)(column, own)
        avg, rate = jnp.sum(jnp.abs(g)) / n, jnp.ones((), g.dtype)
        for _ in range(5):
            big = avg > 0.01
            avg, rate = jnp.where(big, avg / 5, avg), jnp.where(big, rate / 5, rate)
            small = avg < 0.01
            avg, rate = jnp.where(small, avg * 5, avg), jnp.where(small, rate * 5, rate)
        return jax.nn.softmax(5.0 * (column - rate * g))
    return jax.vmap(step, in_axes=(1, 0), out_axes=1)(coef, soft)


def absorb(server: Any, ids: jax.Array, soft: jax.Array, size: jax.Array, lam: float,
           rho: float, lr: float, simplex: bool = False, update: str = "kl") -> Any:
    """The server's round: clients `ids` report their soft predictions and sizes (stored
    over their earlier ones), then c takes its step (`update_coefficients`), projected
    column by column onto the simplex when `simplex`."""
    soft = server.soft.at[ids].set(soft)
    sizes = server.sizes.at[ids].set(size)
    if update == "authors":
        coef = authors_coefficients(server.coef, soft, rho)
    else:
        coef = update_coefficients(server.coef, soft, sizes, lam, rho, lr)
        coef = simplex_columns(coef) if simplex else coef
    return server._replace(coef=coef, soft=soft, sizes=sizes, round=server.round + 1)


def ktpfl(model: nn.Module, client_tx: optax.GradientTransformation, public: jax.Array,
          num_clients: int, distill_share: float, *, temperature: float = 1.0,
          lam: float = 1.0, rho: float = 0.1, coef_lr: float = 0.1, simplex: bool = True,
          coef_update: str = "kl", eval_batch: int = 1000, phase: str = "both"
          ) -> FederatedAlgorithm:
    """KT-pFL for `num_clients` clients of one architecture distilling on `public`
    (normalised images). `phase` "both": the lagged order's one compiled round (the last
    round(distill_share x steps) local steps distil towards the stored predictions; the
    client then uploads its own). The paper order's phases, each taking all its cohort's
    steps (the driver splits them): "train" trains on private data, uploads soft
    predictions and the server update absorbs them; "distill" distils towards the
    broadcast c and predictions from a fresh optimiser, uploads nothing and leaves the
    server as it is."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    local_lib.check_share(distill_share, "KT-pFL's share of local steps for distillation")
    public = jnp.asarray(public, jnp.float32)
    n_pub = public.shape[0]

    def predict(params, model_state):
        """Soft predictions on the whole public set, in chunks."""
        out = []
        for start in range(0, n_pub, eval_batch):
            x = public[start:start + eval_batch]
            logits = model.apply({"params": params, **model_state}, x, train=False)
            out.append(soft_predictions(logits, temperature))
        return jnp.concatenate(out)

    def server_init(variables):
        params, model_state = local_lib.split_variables(variables)
        first = predict(params, model_state)
        return KtServer(params, model_state,
                        jnp.full((num_clients, num_clients), 1.0 / num_clients, jnp.float32),
                        jnp.broadcast_to(first, (num_clients, *first.shape)),
                        jnp.zeros((num_clients,), jnp.float32), jnp.zeros((), jnp.int32))

    def client_init(server, client_state, ctx):
        # ctx.round, not server.round: phase 2's server has already counted the round.
        train = local_lib.init_local(client_tx, client_state, ctx.round)
        target = jnp.einsum("m,mpc->pc", server.coef[:, ctx.client_id], server.soft)
        steps = jnp.asarray(ctx.num_steps, jnp.int32)
        distill_from = {"both": steps - local_lib.phase_steps(distill_share, ctx.num_steps),
                        "train": steps, "distill": jnp.zeros((), jnp.int32)}[phase]
        return KtLocal(train, target, jax.random.fold_in(ctx.rng, 0x4B), distill_from,
                       jnp.asarray(ctx.num_examples, jnp.float32))

    def train_step(local, batch):
        train, metrics = local_lib.sgd_step(model, client_tx, local.train, batch)
        return local._replace(train=train), metrics

    def distill_step(local, batch):
        rows = jax.random.randint(jax.random.fold_in(local.key, local.train.step),
                                  batch["y"].shape, 0, n_pub)
        target = local.target[rows]

        def loss(logits, labels, mask):
            del labels
            per_row = kl_rows(target, soft_predictions(logits, temperature))
            return temperature ** 2 * jnp.sum(per_row * mask)
        public_batch = {"x": public[rows], "y": batch["y"], "mask": jnp.ones_like(batch["mask"])}
        train, _ = local_lib.sgd_step(model, client_tx, local.train, public_batch, loss=loss)
        # The round's training loss is the private data's: distillation steps add nothing.
        return local._replace(train=train), {"loss_sum": jnp.zeros((), jnp.float32),
                                             "num_examples": jnp.zeros((), jnp.float32)}

    def client_step(local, batch, server):
        del server
        if phase != "both":  # one kind of step: no branch of the other compiled
            return (train_step if phase == "train" else distill_step)(local, batch)
        return jax.lax.cond(local.train.step < local.distill_from, train_step, distill_step,
                            local, batch)

    def client_output(local, server):
        del server
        variables = local_lib.model_variables(local.train)
        if phase == "distill":
            return (), variables
        soft = predict(local.train.params, local.train.model_state)
        return {"soft": soft, "size": local.size}, variables

    def server_update(server, outputs, info):
        if phase == "distill":
            return server
        return absorb(server, info.client_ids, outputs["soft"], outputs["size"], lam, rho,
                      coef_lr, simplex, coef_update)

    def download_bytes(server, client_ids, round_index):
        # Each client receives its personalised target (P, C), not a model.
        del client_ids, round_index
        return target_bytes(server.soft)

    # The clients' reports, stacked for `absorb` (phase 2 reports nothing: a sum of ()).
    return federated_algorithm(server_init, client_init, client_step, client_output,
                               server_update, client_state_init=server_model,
                               aggregator=weighted_sum if phase == "distill" else every_output,
                               personal_variables=own_model, download_bytes=download_bytes)


def target_bytes(soft: jax.Array) -> int:
    """Bytes of one client's target: a (P, C) slice of the soft predictions (N, P, C)."""
    return int(np.prod(soft.shape[1:])) * soft.dtype.itemsize


# ----------------------------------------------------------------------------------------
# The driver: the paper's order, and clients of several architectures.
# ----------------------------------------------------------------------------------------

class KtMixedServer(NamedTuple):
    initial: Tuple[PyTree, ...]  # each architecture's initial variables
    coef: jax.Array  # (N, N), as KtServer's
    soft: jax.Array  # (N, P, C)
    sizes: jax.Array  # (N,)
    round: jax.Array


class Group(NamedTuple):
    """The clients of one architecture: global ids (sorted), network, and for each phase
    its order runs (`PHASES`) an algorithm and an executor (on the group's own rows of
    the data)."""
    ids: np.ndarray
    model: nn.Module
    algorithms: Dict[str, FederatedAlgorithm]
    executors: Dict[str, Any]


@dataclasses.dataclass
class KtMixed(RoundDefaults):
    """KT-pFL's server logic as an `engine.protocol.Round` on the engine's `services`, over
    clients of one or several architectures.

    Client n runs `models[arch[n]]` from `initial[arch[n]]`. Each architecture's clients
    form a group with its own algorithms (`ktpfl` on that network) and executors; the group
    sees the shared server state through `view` (c's columns of its clients, every
    client's soft predictions), so its clients' local work is exactly the one-architecture
    algorithm's. Batch orders and keys follow global client ids: how clients are grouped
    changes no number.

    `order` "lagged" (this class's default; the config's is "paper"): each group runs
    `ktpfl`'s compiled round, then c takes one step on every group's reports. "paper":
    `train_phase` (every sampled client trains for steps - round(share x steps) steps and
    reports soft predictions; c takes its step), then each distils for the
    round(share x steps) steps left towards targets of the new c and predictions, from its
    phase-1 model with a fresh optimiser (a "steps" warm-up starts again; momentum from
    private training would carry the model on where the distillation gradient is zero),
    on batches of a stream of its own (`services.cohort(stage=1)`).
    """

    models: Sequence[nn.Module]
    initial: Sequence[PyTree]
    arch: np.ndarray  # (N,) client -> index into `models`
    client_tx: optax.GradientTransformation
    services: Services  # the engine's, over all N clients
    public: Any
    distill_share: float
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)  # ktpfl's keywords
    order: str = "lagged"  # ORDERS

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        self.arch = np.asarray(self.arch, np.int64)
        n = self.services.num_clients
        if self.arch.shape != (n,) or self.arch.min() < 0 or self.arch.max() >= len(self.models):
            raise ValueError(f"arch must give each of the {n} clients an index into the "
                             f"{len(self.models)} architectures, got {self.arch}")
        self.num_clients = n
        self.num_sampled = self.services.num_sampled
        self.phases = ("both",) if self.order == "lagged" else ("train", "distill")
        self.groups: List[Group] = []
        for a, model in enumerate(self.models):
            ids = np.flatnonzero(self.arch == a)
            if not len(ids):
                raise ValueError(f"no client has architecture {a} ({type(model).__name__}): "
                                 f"there are {n} clients for {len(self.models)} architectures")
            algorithms = {p: ktpfl(model, self.client_tx, self.public, len(ids),
                                   self.distill_share, phase=p, **self.options)
                          for p in self.phases}
            per_round = max(1, -(-self.num_sampled * len(ids) // n))
            data = self.services.subset(ids)
            executors = {p: self.services.executor(("group", a, p), algorithms[p],
                                                   self.initial[a], data=data,
                                                   per_round=per_round)
                         for p in self.phases}
            self.groups.append(Group(ids, model, algorithms, executors))
        # Each client's steps per phase, split as the compiled round splits them.
        full = self.services.work.num_steps(self.services.data.sizes)
        distill = np.asarray(local_lib.phase_steps(self.distill_share, full), np.int64)
        self._steps = {"train": full - distill, "distill": distill}
        # Every group's algorithm steps c alike (one set of options): the first group's
        # server update serves the federation, its state carrying the fields it reads.
        update = self.groups[0].algorithms[self.phases[0]].server_update
        self._absorb = jax.jit(lambda server, ids, soft, size: update(
            server, {"soft": soft, "size": size},
            RoundInfo(server.round, ids, jnp.full(ids.shape, 1.0 / ids.shape[0]), n)))
        self._scatter = jax.jit(lambda all_, ids, new: jax.tree_util.tree_map(
            lambda a, b: a.at[ids].set(b), all_, new))

    def view(self, server: KtMixedServer, a: int) -> KtServer:
        """Group a's server state: its initial model and c's columns of its clients."""
        params, model_state = local_lib.split_variables(server.initial[a])
        return KtServer(params, model_state, server.coef[:, self.groups[a].ids], server.soft,
                        server.sizes, server.round)

    def init(self, variables: PyTree) -> SimState:
        """Round 0's state (`variables` unused: each architecture starts from `initial`)."""
        del variables
        n = self.num_clients
        soft, states = None, []
        for g, v in zip(self.groups, self.initial):
            algorithm = g.algorithms[self.phases[0]]
            first = algorithm.server_init(v)
            if soft is None:
                soft = jnp.zeros((n, *first.soft.shape[1:]), jnp.float32)
            soft = soft.at[g.ids].set(first.soft[0])
            one = algorithm.client_state_init(first)
            states.append(jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to(x, (len(g.ids), *np.shape(x))), one))
        server = KtMixedServer(tuple(self.initial), jnp.full((n, n), 1.0 / n, jnp.float32),
                               soft, jnp.zeros((n,), jnp.float32), jnp.zeros((), jnp.int32))
        return SimState(server, tuple(states), 0)

    def sample(self, round_index: int) -> np.ndarray:
        return self.services.sample(round_index)

    def evaluation(self, server: KtMixedServer) -> Tuple[nn.Module, PyTree]:
        """The first architecture's initial model (KT-pFL has no global model)."""
        return self.models[0], server.initial[0]

    def personal_evaluation(self, state) -> None:
        """Clients are scored group by group (`personal_groups`)."""
        del state
        return None

    def personal_groups(self, state) -> List[Tuple[nn.Module, np.ndarray, PyTree]]:
        """(network, client ids, their models stacked) for each architecture."""
        out = []
        for a, (g, states) in enumerate(zip(self.groups, state.client_states)):
            view = self.view(state.server, a)
            personal = g.algorithms[self.phases[0]].personal_variables
            out.append((g.model, g.ids, jax.vmap(personal, in_axes=(None, 0))(view, states)))
        return out

    def _run(self, phase: str, server: KtMixedServer, client_states: Tuple[PyTree, ...],
             ids: np.ndarray, r: int, stage: int = 0):
        """Each group's clients among `ids` run `phase` of round r from `server`: (the
        client states, theirs replaced; their reports (ids, soft predictions, sizes), None
        in phase "distill"; metric sums, with computed_examples)."""
        states = list(client_states)
        reported, soft, size, sums = [], [], [], {"computed_examples": 0}
        for a, g in enumerate(self.groups):
            mine = ids[self.arch[ids] == a]
            if not len(mine):
                continue
            local = np.searchsorted(g.ids, mine)  # their rows in the group's data
            cohort = self.services.cohort(
                mine, r, jax.tree_util.tree_map(lambda x: jnp.asarray(x)[local], states[a]),
                rows=local, stage=stage)
            if phase != "both":
                cohort = cohort._replace(steps=self._steps[phase][mine])
            result = g.executors[phase].run(self.view(server, a), cohort)
            states[a] = self._scatter(jax.tree_util.tree_map(jnp.asarray, states[a]),
                                      jnp.asarray(local), result.client_states)
            if phase != "distill":
                reported.append(mine)
                soft.append(result.outputs["soft"])
                size.append(result.outputs["size"])
            for k, v in jax.device_get(result.metrics).items():
                sums[k] = sums.get(k, 0.0) + float(v)
            sums["computed_examples"] += result.computed_examples
        report = None if not reported else (
            np.concatenate(reported), jnp.concatenate(soft), jnp.concatenate(size))
        return tuple(states), report, sums

    def _absorb_report(self, server: KtMixedServer, report) -> KtMixedServer:
        ids, soft, size = report
        return self._absorb(server, jnp.asarray(ids, jnp.int32), soft, size)

    def _real_examples(self, ids: np.ndarray, phase: str) -> int:
        """Real examples clients `ids` process in `phase`: the engine's count for as many
        steps of a batch order."""
        steps = self._steps[phase][ids]
        work = self.services.work
        return sum(self.services.real_examples(
            ids[steps == s], dataclasses.replace(work, mode="steps", local_steps=int(s)))
            for s in np.unique(steps) if s > 0)

    def train_phase(self, state: SimState) -> Tuple[SimState, Dict[str, Any]]:
        """Phase 1 of round `state.round` in the paper's order: the sampled clients train
        on their private data and report soft predictions on the public set, and c takes
        its step. The state then (round unchanged: phase 2 is to come) and the phase's
        metric sums (with computed_examples)."""
        if self.order != "paper":
            raise ValueError(f"train_phase is the paper order's, not {self.order!r}'s")
        r = state.round
        states, report, sums = self._run("train", state.server, state.client_states,
                                         self.sample(r), r)
        return SimState(self._absorb_report(state.server, report), states, r), sums

    def round(self, state: SimState) -> Tuple[SimState, Dict[str, Any]]:
        """Runs round `state.round` in `order`: the next state and the round's statistics
        (the training loss is the private training's)."""
        r = state.round
        ids = self.sample(r)
        if self.order == "lagged":
            states, report, sums = self._run("both", state.server, state.client_states,
                                             ids, r)
            server = self._absorb_report(state.server, report)
            real = self.services.real_examples(ids)
        else:
            mid, sums = self.train_phase(state)
            server = mid.server
            states, _, more = self._run("distill", server, mid.client_states, ids, r, stage=1)
            sums = {k: v + more[k] for k, v in sums.items()}
            real = self._real_examples(ids, "train") + self._real_examples(ids, "distill")
        computed = sums.pop("computed_examples")
        stats = self.services.statistics(sums, real_examples=real, computed_examples=computed,
                                         download_bytes=float(len(ids) * target_bytes(
                                             state.server.soft)))
        return SimState(server, states, r + 1), stats


def _options(cfg: Any) -> Dict[str, Any]:
    o = cfg.ktpfl
    return dict(temperature=o.temperature, lam=o.lam, rho=o.rho, coef_lr=o.coef_lr,
                simplex=o.simplex, coef_update=o.coef_update, eval_batch=cfg.eval.batch_size)


_distill_share = local_lib.epochs_share("ktpfl", "distill_epochs", "distillation is")


def from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                server_tx: optax.GradientTransformation, *, public: Any) -> FederatedAlgorithm:
    """The lagged order's compiled round (a run in the paper's order takes the driver,
    `mixed_from_config`)."""
    del server_tx  # nothing is averaged
    return ktpfl(model, client_tx, public, cfg.partition.num_clients, _distill_share(cfg),
                 **_options(cfg))


def mixed_from_config(model: nn.Module, cfg: Any, client_tx: optax.GradientTransformation,
                      services: Services, *, public: Any) -> Optional[KtMixed]:
    """The `KtMixed` driver `config.ktpfl` describes: its `order`, over the networks
    `architectures` lists ('': every client runs `model`). None for one network in the
    lagged order: that is one compiled round. Architecture 0 starts from the seed's key
    as the config's model does, architecture a > 0 from the key folded with a; PANs as
    the config sets them."""
    specs = _spec_texts(cfg.ktpfl.architectures)
    order = cfg.ktpfl.order
    if not specs and order == "lagged":
        return None
    data = services.data
    n = data.num_clients
    if n < len(specs):
        raise ValueError(f"architectures lists {len(specs)} models for {n} clients: every "
                         "architecture needs a client")
    num_classes = int(data.label_counts.shape[1])
    pan = None if not cfg.pan.amplitude else cfg.pan.to_dict()
    nets = [models.from_spec(s, num_classes, pan=pan, norm=cfg.model.norm)
            for s in specs] or [model]
    key = jax.random.PRNGKey(cfg.seed)
    initial = [models.init(net, key if a == 0 else jax.random.fold_in(key, a),
                           tuple(data.images.shape[1:])) for a, net in enumerate(nets)]
    return KtMixed(nets, initial, np.arange(n) % len(nets), client_tx, services, public,
                   _distill_share(cfg), _options(cfg), order)


# PUBLIC_SIZE examples held out as the public set unless dataset.public_size says otherwise.
ENTRY = AlgorithmEntry(from_config, OPTIONS, RULES, driver=mixed_from_config,
                       public=PUBLIC_SIZE, personal=True, check=_distill_share,
                       reference=REFERENCE)
