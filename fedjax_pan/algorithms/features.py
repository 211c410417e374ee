"""The cross-cutting features, in the order they wrap an algorithm: PAN's shuffling
(Alg. 2) changes local training, attackers change what trained clients send, compression
changes how it is sent, DP-FedAvg clips and noises what arrives, stragglers change
when it arrives (`stragglers`: the engine's `Simulation` executes them), and recruitment
changes who takes part (the engine asks its `Recruiter`).

Each feature describes itself in one `FeatureEntry` (`algorithms.core`) in its own module;
this tuple is the only list of them: the default config, the schema, the docs and the
assembly derive from it. A new feature is its module with an entry, plus one line here.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterator, Sequence, Tuple

import ml_collections

from fedjax_pan.algorithms.robust import attacks
from fedjax_pan.algorithms.uploads import compressed, dp
from fedjax_pan.algorithms import recruitment, shuffle, stragglers
from fedjax_pan.algorithms.core import FeatureEntry
from fedjax_pan.rules import Rule


FEATURES: Tuple[FeatureEntry, ...] = (shuffle.FEATURE, attacks.FEATURE, compressed.FEATURE,
                                      dp.FEATURE, stragglers.FEATURE, recruitment.FEATURE)


def default_sections(table: Sequence[FeatureEntry] = FEATURES
                     ) -> Dict[str, ml_collections.ConfigDict]:
    """config.<section> for every feature of `table`, at its defaults (fresh copies:
    placeholders are mutable and never shared between configs)."""
    return {f.section: ml_collections.ConfigDict(copy.deepcopy(f.options)) for f in table}


def rules(table: Sequence[FeatureEntry] = FEATURES) -> Dict[str, Rule]:
    """The schema's rule for every key of `table`'s features, by dotted key."""
    return {f"{f.section}.{key}": rule for f in table for key, rule in f.rules.items()}


def check(cfg: Any, table: Sequence[FeatureEntry] = FEATURES) -> None:
    """Every feature's cross-checks (ValueError, its text after 'config.')."""
    for f in table:
        if f.check is not None:
            f.check(cfg)


def active(cfg: Any, table: Sequence[FeatureEntry] = FEATURES
           ) -> Iterator[Tuple[FeatureEntry, str, Any, Any]]:
    """(entry, key, value, value when off) of the first setting that is on, for each
    feature of `table` on in `cfg`, in wrapping order."""
    for f in table:
        on = f.first_on(cfg)
        if on is not None:
            yield (f, *on)


__all__ = ["FEATURES", "default_sections", "rules", "check", "active"]
