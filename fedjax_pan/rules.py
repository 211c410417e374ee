"""Rules for config values: what a value must be, as data (see `schema.RULES`)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Rule:
    """`check(value)` returns None when valid, else what the value must be.

    A numeric rule (`between`) also carries its range as data: `lo` <= value <= `hi`
    (strict where `lo_open` / `hi_open`), a missing bound being -inf / +inf. Other rules
    leave `lo` and `hi` None, so `rule.hi is not None` tells a numeric rule.
    """

    check: Callable[[Any], Optional[str]]
    optional: bool = False  # None (an unset placeholder) is allowed
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def want(self, value: Any) -> Optional[str]:
        """None when `value` keeps the rule (None counts where the rule is optional),
        else what it must be ('set' for a None that is not)."""
        if value is None:
            return None if self.optional else "set"
        return self.check(value)


def _number(value: Any, integer: bool) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "a number"
    if integer and not float(value).is_integer():
        return "an integer"
    if not math.isfinite(value):
        return "finite"
    return None


def _fmt(x: float) -> str:
    # Whole numbers in full (a uint32 seed bound exactly), very large ones as 1e+30.
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e10 else f"{x:g}"


def between(lo: Optional[float] = None, hi: Optional[float] = None, *, lo_open: bool = False,
            hi_open: bool = False, integer: bool = False, optional: bool = False) -> Rule:
    """A finite number in [lo, hi] (open ends where asked), optionally an integer."""
    if lo is None and hi is None:
        raise ValueError("between needs a lower or an upper bound")
    lb = "(" if lo_open else "["
    rb = ")" if hi_open else "]"
    kind = "an integer" if integer else "a number"
    if lo is not None and hi is not None:
        want = f"{kind} in {lb}{_fmt(lo)}, {_fmt(hi)}{rb}"
    elif lo is not None:
        want = f"{kind} {'>' if lo_open else '>='} {_fmt(lo)}"
    else:
        want = f"{kind} {'<' if hi_open else '<='} {_fmt(hi)}"

    def check(value):
        if _number(value, integer):
            return want
        if lo is not None and (value <= lo if lo_open else value < lo):
            return want
        if hi is not None and (value >= hi if hi_open else value > hi):
            return want
        return None
    return Rule(check, optional, -math.inf if lo is None else lo,
                math.inf if hi is None else hi, lo_open, hi_open)


def one_of(options: Sequence[str], optional: bool = False) -> Rule:
    return Rule(lambda v: None if v in options else f"one of {', '.join(map(str, options))}",
                optional)


def directory(value: Any) -> Optional[str]:
    return None if os.path.isdir(os.path.expanduser(str(value))) else "an existing directory"


def boolean(value: Any) -> Optional[str]:
    return None if isinstance(value, bool) else "true or false"


def check_options(rules: "dict[str, Rule]", name: str, **values: Any) -> None:
    """ValueError unless each of `values` keeps its rule in `rules` (an algorithm's RULES),
    named as the config names it: '<name>.<option> must be <what>, got <value>'. What a
    constructor checks of its options, so that one called without a config holds to the
    config's ranges."""
    for key, value in values.items():
        rule = rules[key]
        if getattr(value, "shape", None) == () and hasattr(value, "item"):
            value = value.item()  # a NumPy or JAX scalar, as a caller may pass one
        want = rule.want(value)
        if want is not None:
            raise ValueError(f"{name}.{key} must be {want}, got {value!r}")
