"""The simulation engine: client data, execution strategies, rounds, evaluation."""

from fedjax_pan.engine.clients import Augment, ClientData, LocalWork
from fedjax_pan.engine.compiles import count_compiles
from fedjax_pan.engine.evaluation import make_evaluator
from fedjax_pan.engine.execution import STRATEGIES, make_executor, resolve_strategy
from fedjax_pan.engine.groups import Groups
from fedjax_pan.engine.simulation import SimState, Simulation, clients_per_round
from fedjax_pan.engine.timing import Stragglers

__all__ = ["Augment", "ClientData", "LocalWork", "count_compiles", "make_evaluator",
           "STRATEGIES", "make_executor", "resolve_strategy", "SimState", "Simulation",
           "clients_per_round", "Stragglers", "Groups"]
