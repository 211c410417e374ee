"""Client-level privacy accounting for DP-FedAvg: epsilon at a given delta after t rounds,
from the `dp-accounting` package's RDP accountant (Mironov 2017), composing one sampled
Gaussian mechanism a round.

dp-accounting's noise multiplier is the noise's std over the query's L2 sensitivity under
the neighbouring relation the accountant is built for. DP-FedAvg adds N(0, (z C)^2) to a
sum of updates each clipped to norm C, so the multiplier depends on the relation:

    Poisson sampling (rate q)   add or remove one client: the sum moves by <= C
                                PoissonSampledDpEvent(q, GaussianDpEvent(z))
    uniform, M of K per round   replace one client (the cohort's size is fixed, so a
                                neighbour swaps a client): the sum moves by <= 2 C
                                SampledWithoutReplacementDpEvent(K, M, GaussianDpEvent(z / 2))

The relation is the one each sampling's amplification bound is proved under (Mironov et
al. 2019 for Poisson; Wang et al. 2019 for sampling without replacement), and the two
epsilons are not comparable as numbers: replace-one neighbours differ by two add/remove
steps. Poisson is DP-FedAvg's own analysis (McMahan et al. 2018) and the default under DP
(`config.sampling='auto'`). Example, K = 100, M = 10, T = 200, delta = 1e-5, z = 1:
epsilon 11.1 under Poisson sampling, 158 under uniform sampling.

z is the noise multiplier of the whole round. With adaptive clipping the update's and the
counting query's noises together are one Gaussian mechanism of multiplier z (Andrew et al.
2021, Thm. 1; the split `algorithms.dp.update_noise_multiplier`; the bits are centred to
+-1/2, so their sum moves by 1/2 under add/remove and by 1 under replace-one), so the
account is the same: z under Poisson sampling, z / 2 under uniform sampling.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple

import dp_accounting
import numpy as np
from dp_accounting import dp_event, rdp

from fedjax_pan.workdir import quiet_absl

SAMPLINGS = ("uniform", "poisson")
# The clipped sum's L2 sensitivity in units of the clip norm, under the neighbouring
# relation each sampling is accounted with (module docstring).
SENSITIVITY = {"poisson": 1.0, "uniform": 2.0}
RELATION = {"poisson": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
            "uniform": dp_accounting.NeighboringRelation.REPLACE_ONE}


def _quiet():
    # The accountant logs a warning for every fractional order whose series it cuts off
    # (those orders are left out of the minimum, as documented); they are not ours to act on.
    return quiet_absl(logging.ERROR)


def round_event(noise_multiplier: float, sampling: str, num_clients: int,
                clients_per_round: int, rate: Optional[float] = None) -> dp_event.DpEvent:
    """One round's DP event (module docstring); `rate` q for Poisson sampling (default
    clients_per_round / num_clients)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"unknown sampling {sampling!r}; expected one of {SAMPLINGS}")
    # std z C over the sum's sensitivity: C (add/remove) or 2 C (replace one).
    gaussian = dp_event.GaussianDpEvent(noise_multiplier / SENSITIVITY[sampling])
    if sampling == "poisson":
        q = clients_per_round / num_clients if rate is None else rate
        return dp_event.PoissonSampledDpEvent(q, gaussian)
    return dp_event.SampledWithoutReplacementDpEvent(num_clients, clients_per_round, gaussian)


def make_accountant(sampling: str, orders: Optional[Sequence[float]] = None
                    ) -> rdp.RdpAccountant:
    relation = RELATION[sampling]
    return rdp.RdpAccountant(orders, relation) if orders else rdp.RdpAccountant(
        neighboring_relation=relation)


def epsilon(noise_multiplier: float, rounds: int, delta: float, sampling: str,
            num_clients: int, clients_per_round: int, rate: Optional[float] = None) -> float:
    """Epsilon at `delta` after `rounds` rounds (inf for z = 0, 0 for no round)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    accountant = make_accountant(sampling)
    with _quiet():
        accountant.compose(round_event(noise_multiplier, sampling, num_clients,
                                       clients_per_round, rate), rounds)
        return float(accountant.get_epsilon(delta))


class Ledger:
    """Epsilon round after round for one run: one round's RDP is computed once, and epsilon
    after t rounds is read from t times it, the value `epsilon` gives. So each round's
    epsilon is a function of t and the settings alone, the same float in a resumed run as
    in one that ran through (adding the round's RDP up one round at a time would round
    differently from composing the rounds at once after a resume)."""

    def __init__(self, noise_multiplier: float, delta: float, sampling: str,
                 num_clients: int, clients_per_round: int, rate: Optional[float] = None):
        self.args = (noise_multiplier, sampling, num_clients, clients_per_round, rate)
        self.delta = delta
        self._round_rdp: Optional[Tuple[np.ndarray, np.ndarray]] = None  # (orders, RDP)

    def epsilon(self, rounds: int) -> float:
        """Epsilon at the ledger's delta after `rounds` rounds."""
        if rounds <= 0:
            return 0.0
        if self.args[0] <= 0:
            return float("inf")
        with _quiet():
            if self._round_rdp is None:
                accountant = make_accountant(self.args[1])
                accountant.compose(round_event(*self.args))
                self._round_rdp = accountant.orders, accountant.rdp
            orders, one = self._round_rdp
            # As `epsilon`'s accountant: its RDP starts at 0 and composes `rounds` x one.
            return float(rdp.compute_epsilon(orders, rounds * one, self.delta)[0])


__all__ = ["SAMPLINGS", "SENSITIVITY", "RELATION", "round_event", "make_accountant",
           "epsilon", "Ledger"]
