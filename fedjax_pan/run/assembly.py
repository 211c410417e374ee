"""From a config to a runnable round: data loaded and normalised, clients partitioned, the
model, and the algorithm's round (`make_round`: a `Simulation` of its compiled round, or its
own driver) on the engine. The one assembly path: the training loop, the benchmark suite
and the experiment scripts all start here."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_pan import algorithms, models
from fedjax_pan.models import precision
from fedjax_pan.config import schema
from fedjax_pan import data as data_lib
from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.algorithms import features, sampling
from fedjax_pan.algorithms.fedavg_family import finetune
from fedjax_pan.engine import (Augment, ClientData, LocalWork, Simulation, clients_per_round,
                               count_compiles, make_evaluator, make_executor, resolve_strategy)
from fedjax_pan.engine.evaluation import make_client_evaluator
from fedjax_pan.engine.protocol import Round, placeholder_context
from fedjax_pan.engine import Groups
from fedjax_pan.engine.services import Services
from fedjax_pan.engine.simulation import Tuning
from fedjax_pan.errors import ConfigError, require

__all__ = ["Experiment", "validate", "build", "build_counted", "make_round", "load_dataset",
           "public_split"]


@dataclasses.dataclass
class Experiment:
    config: ml_collections.ConfigDict
    dataset: data_lib.Dataset
    client_indices: List[np.ndarray]
    model: Any
    variables: Any
    simulation: Round  # a Simulation, or an algorithm's driver
    evaluate: Any
    strategy: str
    setup_compiles: int = 0
    # Each client scored on its own test part (partition.test_fraction > 0), else None.
    client_evaluate: Any = None
    test_indices: Optional[List[np.ndarray]] = None
    # Further evaluators of the global model, logged as their accuracy under their name
    # (a backdoor's success rate).
    probes: Dict[str, Any] = dataclasses.field(default_factory=dict)
    # Fields of each evaluated round's row computed from its index alone (DP-FedAvg's
    # epsilon after that many rounds).
    round_fields: Dict[str, Any] = dataclasses.field(default_factory=dict)


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first invalid or unknown value; touches no file."""
    schema.validate(cfg)


def _data_key(cfg: ml_collections.ConfigDict) -> tuple:
    """What determines a run's training data (variants sharing it share one copy)."""
    d = cfg.dataset
    return (d.name, d.data_dir, d.train_limit, cfg.seed)


def load_dataset(name: str, *, data_dir: Optional[str] = None, seed: int = 0,
                 train_limit: Optional[int] = None,
                 test_limit: Optional[int] = None) -> data_lib.Dataset:
    """Dataset `name` ('synthetic': `data.synthetic(seed=seed)`) with seeded random subsets
    of at most `train_limit` / `test_limit` examples (a limit above the size keeps it
    whole). Missing or corrupt data raise ConfigError."""
    if name == "synthetic":
        ds = data_lib.synthetic(seed=seed)
    else:
        try:
            ds = data_lib.load(name, data_dir=data_dir)
        except data_lib.DataError as e:
            raise ConfigError(str(e)) from None
    return data_lib.subset(ds, train_limit, test_limit, seed)


def _load_dataset(cfg: ml_collections.ConfigDict,
                  cache: Optional[Dict[Any, Any]] = None) -> data_lib.Dataset:
    d = cfg.dataset
    key = _data_key(cfg)
    if cache is not None and key in cache:
        return cache[key]
    ds = load_dataset(d.name, data_dir=d.data_dir, seed=cfg.seed, train_limit=d.train_limit)
    if cache is not None:
        cache[key] = ds
    return ds


def _normalized(cfg: ml_collections.ConfigDict, ds: data_lib.Dataset,
                cache: Optional[Dict[Any, Any]]) -> Any:
    """Normalised float32 train and test images on the device, shared through `cache` by
    every variant on the same data (a sweep holds one copy, not one per run)."""
    key = ("normalized", cfg.dataset.normalization, *_data_key(cfg))
    if cache is not None and key in cache:
        return cache[key]
    stats = _stats(cfg, ds)
    train_x = ds.train_images if stats is None else data_lib.normalize(ds.train_images, stats)
    test_x = ds.test_images if stats is None else data_lib.normalize(ds.test_images, stats)
    arrays = (jnp.asarray(train_x, jnp.float32), jnp.asarray(test_x, jnp.float32))
    if cache is not None:
        cache[key] = arrays
    return arrays


def _stats(cfg: ml_collections.ConfigDict, ds: data_lib.Dataset) -> Optional[Any]:
    """The (mean, std) normalising `ds` under `config.dataset.normalization`."""
    if cfg.dataset.normalization == "authors":
        require(ds.name in data_lib.AUTHORS_NORMALIZATION,
                f"config.dataset.normalization='authors' has constants for "
                f"{', '.join(data_lib.AUTHORS_NORMALIZATION)}, not {ds.name!r}")
        return data_lib.AUTHORS_NORMALIZATION[ds.name]
    return data_lib.normalization(ds)


def _augment(cfg: ml_collections.ConfigDict, ds: data_lib.Dataset) -> Optional[Augment]:
    """`config.dataset.augment` as the engine's `Augment` (padding is black, normalised)."""
    if cfg.dataset.augment == "none":
        return None
    stats = _stats(cfg, ds)
    fill = (0.0,) if stats is None else tuple(-m / s for m, s in zip(*stats))
    return Augment(pad=4, flip=True, fill=fill)


def public_split(num_train: int, public_size: int, seed: int
                 ) -> Tuple[np.ndarray, np.ndarray]:
    """(public rows, rows kept for the clients) of the training set: `public_size` rows
    drawn by the seed, held out of every client's data (both sorted)."""
    if public_size <= 0:
        return np.zeros(0, np.int64), np.arange(num_train)
    if public_size >= num_train:
        raise ConfigError(f"{public_size} public examples (config.dataset.public_size, or "
                          f"the algorithm's default where it is 0) must be fewer than the "
                          f"{num_train} training examples: set dataset.public_size")
    perm = np.random.default_rng([seed, 0x9B]).permutation(num_train)
    return np.sort(perm[:public_size]), np.sort(perm[public_size:])


def build(cfg: ml_collections.ConfigDict,
          cache: Optional[Dict[Any, Any]] = None) -> Experiment:
    """Everything a run needs, from a config (validated here); `cache` shares loaded data."""
    validate(cfg)
    ds = _load_dataset(cfg, cache)
    require(ds.num_test > 0, f"the {ds.name} test set is empty: nothing to evaluate on")
    p = cfg.partition
    if p.scheme == "natural":
        # The data decide the clients (FEMNIST: its sampled writers); say how many there are.
        # (The schema has refused datasets without writer groups.)
        groups = len(np.unique(ds.train_groups))
        require(p.num_clients == groups,
                f"config.partition.num_clients={p.num_clients}, but partition.scheme='natural' "
                f"makes one client per writer (natural group) and this {ds.name} training "
                f"data has {groups}: set --config.partition.num_clients={groups}")
    require(p.num_clients <= ds.num_train,
            f"config.partition.num_clients={p.num_clients} exceeds the {ds.num_train} "
            "training examples")
    public_rows, kept = public_split(
        ds.num_train, algorithms.registry.public_size(cfg, ds.num_train), cfg.seed)
    require(len(kept) >= p.num_clients,
            f"{len(public_rows)} public examples (config.dataset.public_size) leave {len(kept)} "
            f"training "
            f"examples for {p.num_clients} clients")
    try:
        groups = None if ds.train_groups is None else np.asarray(ds.train_groups)[kept]
        parts = data_lib.partition(np.asarray(ds.train_labels)[kept], p.num_clients, p.scheme,
                                   cfg.seed, alpha=p.alpha,
                                   classes_per_client=p.classes_per_client,
                                   min_size=p.min_size, balance=p.balance,
                                   num_classes=ds.num_classes, groups=groups)
        parts = [kept[q] for q in parts]  # indices into the whole training set
    except ValueError as e:
        raise ConfigError(f"partition: {e}") from None
    test_parts = None
    if p.test_fraction > 0:
        parts, test_parts = data_lib.split_clients(parts, p.test_fraction, cfg.seed)
    pan = None if not cfg.pan.amplitude else cfg.pan.to_dict()
    try:
        model = models.build(cfg.model.name, ds.num_classes, pan=pan, norm=cfg.model.norm,
                             **cfg.model.options.to_dict())
        variables = models.init(model, jax.random.PRNGKey(cfg.seed), ds.input_shape)
    except (TypeError, ValueError) as e:
        # The first line: JAX appends a paragraph on its filtered traceback frames.
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config.model.options {cfg.model.options.to_dict()} "
                          f"({cfg.model.name} on {ds.name}): {why}") from None
    # Float32 weights built and kept; the model every algorithm and evaluation runs is
    # computed in execution.precision.
    model = precision.policy(model, cfg.execution.precision)
    train_x, test_x = _normalized(cfg, ds, cache)
    train_labels = ds.train_labels
    if p.noisy_share > 0:
        # Only the clients' training parts: test parts and the public set stay clean.
        train_labels, _ = data_lib.noisy_labels(ds.train_labels, parts, p.noisy_share,
                                                p.noise_rate, cfg.seed, ds.num_classes)
    client_data = ClientData.create(train_x, train_labels, parts, ds.num_classes)
    work = LocalWork(cfg.local.batch_size, cfg.local.epochs, cfg.local.mode,
                     cfg.local.local_steps, _augment(cfg, ds))
    evaluate = make_evaluator(model, test_x, ds.test_labels, cfg.eval.batch_size,
                              ds.num_classes)
    local = {}
    if test_parts is not None:
        local = {"client_evaluate": make_client_evaluator(model, train_x, ds.train_labels,
                                                          test_parts, cfg.eval.batch_size),
                 "test_indices": test_parts}
    try:
        strategy = resolve_strategy(cfg.execution.strategy, variables)
    except ValueError as e:
        raise ConfigError(f"config.execution.strategy: {e}") from None
    public = train_x[public_rows] if len(public_rows) else None
    public_labels = np.asarray(ds.train_labels)[public_rows] if len(public_rows) else None
    simulation = make_round(cfg, model, variables, client_data, work, public, public_labels,
                            local.get("client_evaluate"))
    probes = {}
    round_fields = {}
    for feature, *_ in features.active(cfg):
        if feature.probes is not None:
            for name, (images, labels) in feature.probes(cfg, test_x, ds.test_labels).items():
                probes[name] = make_evaluator(model, images, labels, cfg.eval.batch_size,
                                              ds.num_classes)
        if feature.round_fields is not None:
            round_fields.update(feature.round_fields(cfg, len(parts)))
    return Experiment(cfg, ds, parts, model, variables, simulation, evaluate, strategy,
                      probes=probes, round_fields=round_fields, **local)


def make_round(cfg: ml_collections.ConfigDict, model: Any, variables: Any,
               client_data: ClientData, work: LocalWork, public: Any = None,
               public_labels: Any = None, client_evaluate: Any = None) -> Round:
    """The round `cfg.algorithm` runs on `client_data`: the algorithm's own driver where it
    gives one for this config (FedMA; KT-pFL in the paper's order or over several
    architectures), else a `Simulation` of its compiled round with the features the config
    turns on (`algorithms.features`, in their order), executed as `cfg.execution` says.
    Config errors raise ConfigError."""
    entry = algorithms.ALGORITHMS[cfg.algorithm]
    cohort = sampling.cohort_sampling(cfg)
    try:
        # What the config selects by name, resolved here: drivers never read the registry.
        services = Services(
            client_data, work, cfg.participation, cfg.seed, cfg.execution.strategy,
            cfg.execution.block_size,
            server_tx=algorithms.registry.server_optimizer(cfg.server.optimizer, cfg.server.lr,
                                                           cfg.server.momentum),
            sampling=cohort,
            attack=(None if attacks.FEATURE.first_on(cfg) is None else
                    lambda algorithm, malicious: attacks.from_config(
                        algorithm, cfg, client_data.num_clients,
                        int(client_data.label_counts.shape[1]), cohort, malicious)))
        needs = {"public_labels": public_labels, "client_evaluate": client_evaluate}
        simulation = None if entry.driver is None else entry.driver(
            model, cfg, algorithms.registry.client_tx(cfg), services,
            **({"public": public} if entry.public else {}),
            **{name: needs[name] for name in entry.driver_needs})
        if cfg.model.architectures:
            simulation = _groups(cfg, client_data, services, public, public_labels)
        algorithm = None if simulation is not None else algorithms.from_config(
            model, cfg, public=public, public_labels=public_labels,
            input_shape=client_data.images.shape[1:])
        if algorithm is not None:
            # Options checked against the model's layers fail here, not in round 1.
            jax.eval_shape(lambda v: algorithm.client_state_init(algorithm.server_init(v)),
                           variables)
    except ValueError as e:
        why = str(e).strip().splitlines()[0]
        raise ConfigError(f"config.{cfg.algorithm}: {why}") from None
    if simulation is not None:
        require(jax.process_count() == 1,
                f"algorithm {cfg.algorithm!r} as configured runs on its own driver, which "
                f"runs in one process, not {jax.process_count()}")
        if not isinstance(simulation, Round):
            raise TypeError(f"{cfg.algorithm}'s driver {type(simulation).__name__} lacks "
                            f"engine.protocol.Round's members")
        # A driver applies none of the features unless it says it does (Siren's attackers
        # are among its own clients).
        refused = [(key, repr(off)) for f, key, _, off in features.active(cfg)
                   if f.section not in simulation.features]
        if cohort != "uniform":
            refused.append(("sampling", "'uniform'"))
        if cfg.eval.finetune_epochs:
            refused.append(("eval.finetune_epochs", "0"))
        if refused:
            key, off = refused[0]
            raise ConfigError(f"config.{key} is not available with algorithm "
                              f"{cfg.algorithm!r} as configured (its rounds run on its own "
                              f"driver): set {key}={off}")
        return simulation
    num_classes = int(client_data.label_counts.shape[1])
    if algorithm.aggregator.space == "model":
        _check_model_view(algorithm, variables, num_classes, cfg,
                          f"aggregation.rule={cfg.aggregation.rule!r}")
    build = algorithms.core.Build(cfg, model, variables, client_data.num_clients, num_classes,
                                  cohort)
    engine_options: Dict[str, Any] = {}
    for feature, key, value, _ in features.active(cfg):
        if feature.needs_model(cfg):
            _check_model_view(algorithm, variables, num_classes, cfg, f"{key}={value!r}")
        try:
            if feature.wrap is not None:  # recruitment changes who takes part, not how
                algorithm = feature.wrap(algorithm, build)
            # Refusals that depend on the model (BatchNorm under DP) fail here.
            jax.eval_shape(algorithm.server_init, variables)
        except ValueError as e:
            raise ConfigError(f"config.{key}={value!r}: {e}") from None
        if feature.simulation is not None:
            engine_options.update(feature.simulation(cfg))
    try:
        executor = make_executor(resolve_strategy(cfg.execution.strategy, variables),
                                 algorithm, work, client_data, variables,
                                 clients_per_round(cfg.participation, client_data.num_clients),
                                 cfg.execution.block_size)
    except ValueError as e:
        raise ConfigError(f"config.execution: {e}") from None
    return Simulation(algorithm, client_data, work, executor, cfg.participation,
                      cfg.aggregation.weights, cfg.seed, sampling=cohort,
                      states_in=cfg.execution.client_states,
                      tuning=_tuning(cfg, model, variables, client_data, work),
                      **engine_options)


def _groups(cfg: ml_collections.ConfigDict, client_data: ClientData, services: Services,
            public: Any, public_labels: Any) -> Groups:
    """Clients of the networks `cfg.model.architectures` lists, client n running the
    (n mod A)-th (PFLlib's heterogeneous clients), each network's clients a group
    (`engine.groups`). Network 0 starts from the seed's key as the config's model does,
    network a > 0 from it folded with a; PANs as the config sets them."""
    specs = models.spec_texts(cfg.model.architectures)
    n = client_data.num_clients
    if n < len(specs):
        raise ValueError(f"model.architectures lists {len(specs)} networks for {n} clients: "
                         f"every network needs a client")
    num_classes = int(client_data.label_counts.shape[1])
    pan = None if not cfg.pan.amplitude else cfg.pan.to_dict()
    nets = [models.from_spec(s, num_classes, pan=pan, norm=cfg.model.norm) for s in specs]
    key = jax.random.PRNGKey(cfg.seed)
    initial = [models.init(net, key if a == 0 else jax.random.fold_in(key, a),
                           tuple(client_data.images.shape[1:])) for a, net in enumerate(nets)]
    nets = [precision.policy(net, cfg.execution.precision) for net in nets]
    built = [algorithms.from_config(net, cfg, public=public, public_labels=public_labels,
                                    input_shape=client_data.images.shape[1:])
             for net in nets]
    return Groups(nets, initial, np.arange(n) % len(nets), built, services,
                  cfg.aggregation.weights)


def _tuning(cfg: ml_collections.ConfigDict, model: Any, variables: Any,
            client_data: ClientData, work: LocalWork) -> Optional[Tuning]:
    """`cfg.eval.finetune_epochs` epochs of local fine-tuning before each evaluation
    (None at 0), executed as training is."""
    epochs = cfg.eval.finetune_epochs
    if not epochs:
        return None
    tune_work = dataclasses.replace(work, epochs=float(epochs), mode="epochs",
                                    local_steps=None)
    algorithm = finetune.fine_tuning(model, algorithms.registry.client_tx(cfg))
    executor = make_executor(resolve_strategy(cfg.execution.strategy, variables), algorithm,
                             tune_work, client_data, variables,
                             clients_per_round(cfg.participation, client_data.num_clients),
                             cfg.execution.block_size)
    return Tuning(algorithm, tune_work, executor)


def _check_model_view(algorithm: Any, variables: Any, num_classes: int,
                      cfg: ml_collections.ConfigDict, what: str) -> None:
    """ConfigError unless the algorithm's outputs stand for models (`model_view`): what
    the setting `what` (a feature's, or a model-space aggregation rule) changes or
    combines."""
    ctx = placeholder_context(num_classes)
    view = algorithm.model_view
    try:
        require(view is not None, "")
        server = jax.eval_shape(algorithm.server_init, variables)
        output = jax.eval_shape(lambda s: algorithm.client_output(algorithm.client_init(
            s, algorithm.client_state_init(s), ctx), s)[0], server)
        jax.eval_shape(view.to_model, server, output)
    except (TypeError, ConfigError):
        raise ConfigError(f"config.{what} needs clients that send a model or an update, "
                          f"and {cfg.algorithm!r} sends neither") from None


def build_counted(cfg: ml_collections.ConfigDict,
                   cache: Optional[Dict[Any, Any]] = None) -> Experiment:
    """`build`, with the compilations it took (a run's summary counts them)."""
    with count_compiles() as c:
        exp = build(cfg, cache)
    exp.setup_compiles = c.count
    return exp
