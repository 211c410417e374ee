"""Privacy accounting equals `dp-accounting`'s own composition for the same parameters,
grows with rounds, and the per-run ledger gives its value at every round, resumed or
not."""

import math

import numpy as np
import pytest
from dp_accounting import NeighboringRelation, dp_event, rdp

from fedjax_pan.algorithms.uploads import privacy


def _reference(z, rounds, delta, event, relation):
    accountant = rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


@pytest.mark.reference("privacy", "accountant")
def test_poisson_epsilon_equals_the_rdp_accountant():
    want = _reference(1.1, 50, 1e-5,
                      dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.1)),
                      NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert privacy.epsilon(1.1, 50, 1e-5, "poisson", 100, 10) == pytest.approx(want, rel=1e-12)
    assert privacy.epsilon(1.1, 50, 1e-5, "poisson", 100, 10, rate=0.1) == pytest.approx(want)


@pytest.mark.reference("privacy", "accountant")
def test_uniform_epsilon_accounts_for_replacing_one_client():
    # dp-accounting's multiplier is std / sensitivity. Uniform cohorts are accounted under
    # REPLACE_ONE, where swapping one client's update (norm <= C) for another's moves the
    # clipped sum by up to 2 C, while the noise's std is z C.
    clip, z = 0.7, 1.1
    want = _reference(z, 50, 1e-5, dp_event.SampledWithoutReplacementDpEvent(
        100, 10, dp_event.GaussianDpEvent(z * clip / (2 * clip))),
        NeighboringRelation.REPLACE_ONE)
    assert privacy.epsilon(z, 50, 1e-5, "uniform", 100, 10) == pytest.approx(want, rel=1e-12)


@pytest.mark.reference("privacy", "accountant")
def test_the_reported_example_k100_m10_t200():
    # K = 100, M = 10, T = 200, delta = 1e-5, z = 1: 158 uniform (20.7 was logged when the
    # multiplier was taken as z under REPLACE_ONE), 11.1 Poisson.
    uniform = privacy.epsilon(1.0, 200, 1e-5, "uniform", 100, 10)
    assert uniform == pytest.approx(157.7, abs=0.1)
    assert privacy.epsilon(1.0, 200, 1e-5, "poisson", 100, 10) == pytest.approx(11.06, abs=0.01)
    under_reported = _reference(1.0, 200, 1e-5, dp_event.SampledWithoutReplacementDpEvent(
        100, 10, dp_event.GaussianDpEvent(1.0)), NeighboringRelation.REPLACE_ONE)
    assert under_reported == pytest.approx(20.7, abs=0.1) and uniform > 7 * under_reported


def test_epsilon_grows_with_rounds_and_falls_with_noise():
    eps = [privacy.epsilon(1.0, t, 1e-5, "poisson", 100, 10) for t in (1, 10, 100)]
    assert eps[0] < eps[1] < eps[2]
    assert privacy.epsilon(2.0, 100, 1e-5, "poisson", 100, 10) < eps[2]
    assert privacy.epsilon(0.0, 10, 1e-5, "poisson", 100, 10) == math.inf
    assert privacy.epsilon(1.0, 0, 1e-5, "poisson", 100, 10) == 0.0


def test_ledger_agrees_round_by_round_and_after_going_back():
    ledger = privacy.Ledger(0.9, 1e-5, "uniform", 50, 5)
    got = [ledger.epsilon(t) for t in (1, 2, 5, 6)]
    want = [privacy.epsilon(0.9, t, 1e-5, "uniform", 50, 5) for t in (1, 2, 5, 6)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert ledger.epsilon(3) == pytest.approx(privacy.epsilon(0.9, 3, 1e-5, "uniform", 50, 5))


def test_ledger_epsilon_depends_on_the_round_alone():
    """A resumed run's ledger starts at its checkpoint's round; each round's epsilon is the
    same float as in the run that went through (here round 8 differed in its last bit when
    the ledger added one round at a time and the resumed one composed 7 at once)."""
    args = (1.1, 1e-4, "poisson", 20, 4, 0.2)
    through = privacy.Ledger(*args)
    want = [through.epsilon(t) for t in range(1, 9)]
    resumed = privacy.Ledger(*args)
    assert [resumed.epsilon(t) for t in (7, 8)] == want[6:]
    assert want[6:] == [privacy.epsilon(1.1, t, 1e-4, "poisson", 20, 4, 0.2) for t in (7, 8)]


def test_unknown_sampling():
    with pytest.raises(ValueError, match="unknown sampling 'fixed'"):
        privacy.round_event(1.0, "fixed", 10, 2)
