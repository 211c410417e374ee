"""The round contract the engine runs: an algorithm as a few pure functions over pytrees,
and `Round`, what the engine's loop drives (a `Simulation`, or an algorithm's driver where
its round is not one compiled function: FedMA, KT-pFL over several networks).

Every function takes its state first, then its inputs, and returns the new state first:

    server_init(variables)                        -> server_state
    client_state_init(server_state)               -> client_state   (None: stateless)
    client_init(server_state, client_state, ctx)  -> local_state
    client_step(local_state, batch, server_state) -> (local_state, step_metrics)
    client_output(local_state, server_state)      -> (output, client_state)
    server_update(server_state, aggregate, info)  -> server_state
    eval_variables(server_state)                  -> model variables to evaluate
    personal_variables(server_state, client_state) -> the variables a client evaluates on
                                                     its own test data (optional; None:
                                                     the global model)
    personal_adapt(server_state, client_state, batch) -> the same, adapted on one batch of
                                                     the client's training data first
                                                     (optional; Per-FedAvg's one step)
    aggregator                                    how outputs become `aggregate`
    upload_bytes(output, local_state)             -> bytes sent (optional)
    download_bytes(server_state, client_ids, round) -> bytes each client receives (optional)
    model_view                                    the model an output stands for, and
                                                  back (optional; attacks and model-space
                                                  defences need it)

`ctx` is a `ClientContext`; `server_state` in `client_step` is the round's broadcast
(read-only: a client need not copy it into its local state). `batch` is
{'x': (B, H, W, C) float32, 'y': (B,) int32, 'mask': (B,) float32}; padded examples have
mask 0. `step_metrics` are sums over the batch: 'loss_sum' and 'num_examples', plus any the
algorithm reports; the engine adds them up over steps and clients and logs each
'<name>_sum' as `train_<name>` per example. The aggregate is, by default, the weighted mean
of the clients' outputs (`weighted_mean`); see `Aggregator` for the others. `info` is a
`RoundInfo`. The engine owns sampling, execution, evaluation and checkpoints; an algorithm
never sees how its clients are executed.
"""

from __future__ import annotations

from typing import (Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple,
                    runtime_checkable)

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
tree_map = jax.tree_util.tree_map


class ClientContext(NamedTuple):
    """What a client knows about its own round (scalars, or vectors when vmapped)."""

    rng: Any  # this client's key for this round
    num_steps: Any  # local steps it takes
    num_examples: Any  # examples it holds
    client_id: Any  # its index in 0..K-1
    round: Any  # the round's index, from 0
    label_counts: Any  # (C,) float32 histogram of its labels


def placeholder_context(num_classes: int) -> ClientContext:
    """A client's context of placeholder values: for tracing shapes (`jax.eval_shape`) of
    what an algorithm's client functions return, never for training."""
    return ClientContext(jax.random.PRNGKey(0), jnp.int32(1), jnp.int32(1), jnp.int32(0),
                         jnp.int32(0), jnp.zeros(num_classes, jnp.float32))


class RoundInfo(NamedTuple):
    """What the server update knows about the round it closes."""

    round: Any  # the round's index, from 0
    client_ids: Any  # (M,) int32, the sampled clients
    weights: Any  # (M,) float32 aggregation weights (summing to 1)
    num_clients: int  # K


class Arrivals(NamedTuple):
    """What a stacked aggregator knows of the outputs it combines besides their weights
    (arrays over the same leading axis N)."""

    staleness: Any  # (N,) int32: rounds since the broadcast each output was trained from
    scores: Dict[str, Any]  # {name: (N,)} the aggregator's `score` of each, at its origin
    round: Any  # the index of the round being closed
    current: PyTree  # the server's model now (`eval_variables`; model-space rules mix it)


class Aggregator(NamedTuple):
    """How the clients' outputs become the server update's `aggregate`.

    Streaming (`stacked=False`): the engine keeps only sum_k w_k * output_k and calls
    `finalize(output_sum, total_weight)`. Stacked: it keeps every client's output and calls
    `finalize(outputs, weights, arrivals)` with a leading client axis (N, ...), weights (N,)
    summing to 1, and `Arrivals` (memory: N copies of an output). A weight of 0 marks a
    slot that holds no output this round (a client not yet arrived): every stacked rule
    ignores it.

    `space='model'`: the rule combines models, not outputs. The engine hands it each
    client's model (the algorithm's `model_view.to_model`, taken against the broadcast the
    client trained from) and turns the model it returns back into an output against the
    current server (`to_output`). `score(variables) -> {name: scalar}` is computed for each
    client's model when its output is made (SageFlow's loss and entropy on public data) and
    reaches `finalize` in `arrivals.scores`. `report(entries, weights, arrivals)` (stacked
    rules only) is `finalize` that also says what the rule found about each client of the
    round: (what `finalize` returns, {name: (N,)}), e.g. the weights FAIR's rule learned,
    computed once for both; the engine calls it instead of `finalize` when its `Recruiter`
    needs the report.
    """

    finalize: Callable[..., PyTree]
    stacked: bool = False
    space: str = "output"
    score: Optional[Callable[[PyTree], Dict[str, Any]]] = None
    # True: a round without clients (Poisson sampling) still runs the server update, on a
    # zero sum and total weight 0 (DP-FedAvg's fixed denominator adds its noise); False:
    # the server stays as it was.
    closes_empty: bool = False
    report: Optional[Callable[..., Tuple[PyTree, Dict[str, Any]]]] = None


class Recruiter(NamedTuple):
    """Which clients a round takes when the server recruits them instead of sampling
    (FAIR's reverse auction): host-side functions over a state of NumPy arrays that the
    engine keeps in `SimState.selection` and checkpoints.

    `init(num_clients)` -> the first state; `select(state, round)` -> (the round's client
    ids, sorted; the state after selecting; {name: value} for the round's row): a pure
    function of its arguments, so a resumed run recruits identically;
    `observe(state, ids, report, round)` -> (state, {name: value}) after the server update,
    `report` being the aggregator's `report` for `ids` as NumPy arrays ({} without one).
    The names a recruiter reports start with 'recruit_' (they go to metrics.jsonl).
    """

    init: Callable[[int], Any]
    select: Callable[[Any, int], Tuple[Any, Any, Dict[str, Any]]]
    observe: Callable[[Any, Any, Dict[str, Any], int], Tuple[Any, Dict[str, Any]]]


def _mean(output_sum: PyTree, total_weight: Any) -> PyTree:
    return tree_map(lambda x: x / total_weight.astype(x.dtype), output_sum)


def _sum(output_sum: PyTree, total_weight: Any) -> PyTree:
    del total_weight
    return output_sum


# The default: sum_k w_k out_k / sum_k w_k, streamed (no client's output is kept).
weighted_mean = Aggregator(_mean)
# For per-leaf or per-group weights: clients send numerators and denominators, already
# weighted as they like, and the server update divides.
weighted_sum = Aggregator(_sum)


class ModelView(NamedTuple):
    """The model a client's output stands for, and back: `to_model(server, output)` ->
    the variables the client in effect sends (its broadcast `server` plus its update, for
    FedAvg's family); `to_output(server, variables)` -> the output that stands for
    `variables` against `server`. Attacks act on the model, and model-space rules
    (SageFlow, FedAsync, Zeno) combine models."""

    to_model: Callable[[PyTree, PyTree], PyTree]
    to_output: Callable[[PyTree, PyTree], PyTree]
    # Where the output holds the parameter update itself (FedAvg's delta): read it and
    # replace it without the round trip through the model (two passes fewer a client).
    update: Optional[Callable[[PyTree, PyTree], PyTree]] = None  # (server, output) -> update
    with_update: Optional[Callable[[PyTree, PyTree, PyTree], PyTree]] = None


def output_update(view: ModelView, server: PyTree, output: PyTree, broadcast: PyTree
                  ) -> PyTree:
    """The parameter update an output stands for: its model's parameters less
    `broadcast` (the parameters of `server`'s model), or `view.update`."""
    if view.update is not None:
        return view.update(server, output)
    return tree_map(jnp.subtract, view.to_model(server, output)["params"], broadcast)


def with_output_update(view: ModelView, server: PyTree, output: PyTree, update: PyTree,
                       broadcast: PyTree) -> PyTree:
    """`output` standing for parameters `broadcast + update` instead (its other state
    unchanged), or `view.with_update`."""
    if view.with_update is not None:
        return view.with_update(server, output, update)
    model = view.to_model(server, output)
    return view.to_output(server, {**model, "params": tree_map(jnp.add, broadcast, update)})


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions (see the module docstring for signatures)."""

    server_init: Callable[[PyTree], PyTree]
    client_state_init: Callable[[PyTree], PyTree]
    client_init: Callable[[PyTree, PyTree, Any], PyTree]
    client_step: Callable[[PyTree, PyTree, PyTree], tuple]
    client_output: Callable[[PyTree, PyTree], tuple]
    server_update: Callable[[PyTree, PyTree, RoundInfo], PyTree]
    eval_variables: Callable[[PyTree], PyTree]
    aggregator: Aggregator = weighted_mean
    # upload_bytes(output, local_state) -> bytes this client sends (None: its whole output;
    # e.g. Psi-Net's trimmed groups are not sent).
    upload_bytes: Optional[Callable[[PyTree, PyTree], Any]] = None
    # personal_variables(server_state, client_state) -> the model a client evaluates on its
    # own test part (None: the global model, `eval_variables`).
    personal_variables: Optional[Callable[[PyTree, PyTree], PyTree]] = None
    # personal_adapt(server_state, client_state, batch) -> that model when the client first
    # adapts it on one batch of its own training data (takes precedence; None: none).
    personal_adapt: Optional[Callable[[PyTree, PyTree, PyTree], PyTree]] = None
    # How outputs map to models (None: they do not, e.g. predictions or control variates).
    model_view: Optional[ModelView] = None
    # download_bytes(server_state, client_ids (M,), round) -> the bytes each of the M
    # clients receives, (M,) int32 or one number for all (None: each the whole
    # `eval_variables(server_state)`).
    download_bytes: Optional[Callable[[PyTree, Any, Any], Any]] = None


def stacked_entries(algorithm: FederatedAlgorithm, server: PyTree, outputs: PyTree
                    ) -> Tuple[PyTree, Dict[str, Any]]:
    """The stacked `outputs` of clients that trained from `server` as the algorithm's
    stacked aggregator combines them (a model-space rule: their models), with their
    scores ({} without `Aggregator.score`)."""
    agg = algorithm.aggregator
    if agg.space == "model":
        outputs = jax.vmap(algorithm.model_view.to_model, in_axes=(None, 0))(server, outputs)
    return outputs, ({} if agg.score is None else jax.vmap(agg.score)(outputs))


def stacked_aggregate(algorithm: FederatedAlgorithm, server: PyTree, entries: PyTree,
                      weights: Any, arrivals: Arrivals, report: bool = False) -> PyTree:
    """The stacked aggregator's `aggregate` for `server_update(server, ...)` from
    `stacked_entries`' entries (a model-space rule's model becomes an output); with
    `report`, (aggregate, the aggregator's report) from one call of its `report`."""
    agg = algorithm.aggregator
    if report:
        combined, found = agg.report(entries, weights, arrivals)
    else:
        combined, found = agg.finalize(entries, weights, arrivals), None
    aggregate = (algorithm.model_view.to_output(server, combined) if agg.space == "model"
                 else combined)
    return (aggregate, found) if report else aggregate


def tree_bytes(tree: PyTree) -> int:
    """Bytes of a pytree's leaves (arrays or shape-dtype structs): what sending it costs."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                   for x in jax.tree_util.tree_leaves(tree)))


@runtime_checkable
class Round(Protocol):
    """What the engine's training loop drives, round after round (`Simulation` for a
    `FederatedAlgorithm`; a driver for server logic that is not one compiled round).

    `init(variables)` -> the first state (a `SimState`: server, client_states, round);
    `round(state)` -> (next state, the round's statistics: train_loss, real_examples,
    computed_examples, upload_bytes, optional download_bytes and train_* metrics);
    `evaluation(server)` -> (network, variables) the global model is scored with;
    `personal_evaluation(state)` -> each client's own variables stacked (K, ...), or None
    where clients are scored on the global model; `personal_groups(state)` -> for clients
    of several networks, [(network, client ids, stacked variables)] per network, else None.
    `num_sampled`: clients a round; `shapes_change`: checkpoints restore the saved shapes
    (a model that grows); `features`: the config sections of cross-cutting features the
    round applies itself (Siren puts `attack`'s malicious clients among its own; the
    assembly refuses any other feature that is on for a driver). `attach(workdir,
    resume)` is called before `init` (where a round keeps records beside the run:
    FLChain's ledger, disk-held client states); `report(state)` -> entries the run's
    summary.json gains (FLChain's trust anchor). `RoundDefaults` gives the last three
    their empty defaults.
    """

    num_sampled: int
    shapes_change: bool
    features: Tuple[str, ...]

    def init(self, variables: PyTree) -> Any: ...

    def round(self, state: Any) -> Tuple[Any, Dict[str, Any]]: ...

    def evaluation(self, server: PyTree) -> Tuple[Any, PyTree]: ...

    def personal_evaluation(self, state: Any) -> Optional[PyTree]: ...

    def personal_groups(self, state: Any) -> Optional[List[Tuple[Any, np.ndarray, PyTree]]]: ...

    def attach(self, workdir: str, resume: bool) -> None: ...

    def report(self, state: Any) -> Dict[str, Any]: ...


class RoundDefaults:
    """`Round`'s optional members at their defaults, for a driver to inherit: it applies
    no feature itself, keeps nothing beside the run and reports nothing more."""

    features: Tuple[str, ...] = ()
    # Checkpoints restore into the shapes of `init`'s state (a driver whose model grows,
    # as FedMA's, sets this to restore the saved shapes).
    shapes_change: bool = False

    def attach(self, workdir: str, resume: bool) -> None:
        del workdir, resume

    def report(self, state: Any) -> Dict[str, Any]:
        del state
        return {}
