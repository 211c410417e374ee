"""Config rules as constructors check them: `rules.check_options`."""

import numpy as np
import pytest

from fedjax_pan.rules import between, check_options, one_of

RULES = {"lam": between(0, 1e4), "tau": between(0, 1, lo_open=True, optional=True),
         "steps": between(1, 10, integer=True), "kind": one_of(("a", "b"))}


def test_good_options_pass_and_an_optional_one_may_be_none():
    check_options(RULES, "algo", lam=0.0, tau=None, steps=3, kind="b")
    check_options(RULES, "algo", lam=np.float32(2.0), steps=np.int64(10))  # NumPy scalars


@pytest.mark.parametrize("values,message", [
    (dict(lam=-1.0), r"^algo.lam must be a number in \[0, 10000\], got -1.0$"),
    (dict(tau=0.0), r"^algo.tau must be a number in \(0, 1\], got 0.0$"),
    (dict(steps=2.5), r"^algo.steps must be an integer in \[1, 10\], got 2.5$"),
    (dict(kind="c"), r"^algo.kind must be one of a, b, got 'c'$"),
    (dict(lam=None), r"^algo.lam must be set, got None$")])
def test_a_bad_option_is_named_with_its_value_and_what_it_must_be(values, message):
    with pytest.raises(ValueError, match=message):
        check_options(RULES, "algo", **values)
