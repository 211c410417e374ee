"""VGG9 and a small CNN per execution strategy (and what `auto` picks)."""

from __future__ import annotations

from typing import Any, Dict

from benchmarks.harness import (Log, Settings, auto_summary, equal_parts, make_workload,
                                time_strategies)
from benchmarks.roofline import Roof
from fedjax_pan import data as data_lib
from fedjax_pan import models


def conv_section(settings: Settings, roof: Roof, log: Log) -> Dict[str, Any]:
    """Convnets per strategy with the naive loop; what `auto` picks and how it fares."""
    out = {}
    for b in settings.conv:
        n = b.clients_per_round * b.examples
        ds = data_lib.synthetic(n, b.test_examples, image_shape=b.input_shape,
                                seed=settings.seed)
        model = models.build(b.model, 10, width=b.width)
        w = make_workload(b.key, model, b.input_shape, ds.train_images, ds.train_labels,
                          equal_parts(b.clients_per_round, b.examples, settings.seed),
                          ds.test_images, ds.test_labels, b.batch_size, 1, settings)
        configs, extra, _ = time_strategies(w, b.clients_per_round, settings, roof, log,
                                             b.key)
        out[b.key] = {"model": b.model, "width": b.width, "input_shape": list(b.input_shape),
                      "gates_auto_target": b.gates_auto,
                      "workload": w.describe(b.clients_per_round), "strategies": configs,
                      **extra, "auto": auto_summary(configs, w.variables)}
    return out
