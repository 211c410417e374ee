"""Targets, the printed table and RESULTS.md, all derived from the results tree."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

Results = Dict[str, Any]

# (name, section path, threshold, comparison); values are looked up by `_target_value`.
TARGETS = (
    ("MLP bench local training >= 85% of its roofline", "mlp_roofline", 0.85, ">="),
    ("End-to-end MLP round >= 1.25x faster than the naive loop", "mlp_speedup", 1.25, ">="),
    ("Padding efficiency >= 90% at alpha=0.1", "padding", 0.90, ">="),
    ("auto within 10% of the best strategy (MLP)", "auto_mlp", 1.10, "<="),
    ("auto within 10% of the best strategy (VGG9)", "auto_vgg9", 1.10, "<="),
    ("FedProx round <= 1.25x FedAvg's", "algo_fedprox", 1.25, "<="),
    ("Scaffold round <= 1.25x FedAvg's", "algo_scaffold", 1.25, "<="),
    ("FedDyn round <= 1.25x FedAvg's", "algo_feddyn", 1.25, "<="),
    ("MOON round <= 1.9x FedAvg's (three forward passes)", "algo_moon", 1.90, "<="),
    ("Multi-Krum round <= 1.3x FedAvg's at 10 clients a round", "defence_multi_krum", 1.3,
     "<="),
    ("SageFlow round (public-set scoring) <= 1.3x FedAvg's at 10 clients a round",
     "defence_sageflow", 1.3, "<="),
    ("top-k (10%) upload round <= 1.1x FedAvg's", "compression_top_k 10%", 1.10, "<="),
    ("QSGD (16 levels) upload round <= 1.1x FedAvg's", "compression_qsgd 16 levels", 1.10,
     "<="),
    ("DP-FedAvg clipping and noise round <= 1.1x FedAvg's", "compression_dp clipping (z = 1)",
     1.10, "<="),
    ("auto's grouped conv within 10% of the fastest (grouped VGG9 step)", "grouped_impl",
     1.10, "<="),
    ("auto within 10% of the best strategy (grouped models)", "grouped_strategy", 1.10,
     "<="),
    ("FedJAX workload: engine (auto) training throughput >= 1.1x the FedJAX-style loop",
     "throughput_fedjax", 1.10, ">="),
    ("FedJAX workload: engine (auto) training throughput >= 1.3x PFLlib-style PyTorch",
     "throughput_pytorch", 1.30, ">="),
    ("auto's training at least the naive loop's speed on every workload", "auto_vs_naive",
     1.0, ">="),
)


def _target_value(results: Results, key: str) -> Optional[float]:
    """The measured figure a target is judged on (for `auto`'s pick), None if not run."""
    if key.startswith("mlp") and "mlp" in results:
        rec = results["mlp"]["strategies"][results["mlp"]["auto"]["picks"]]
        return (rec.get("fraction_of_roofline") if key == "mlp_roofline"
                else rec["speedup_vs_naive"])
    if key == "padding" and "padding" in results:
        pad = results["padding"]
        return pad["configs"][pad["auto"]["picks"]]["padding_efficiency"]
    if key == "auto_mlp" and "mlp" in results:
        return results["mlp"]["auto"]["ratio_to_best"]
    if key.startswith("algo_") and "algorithms" in results:
        rec = results["algorithms"]["algorithms"].get(key[len("algo_"):])
        return None if rec is None else rec["vs_fedavg"]
    if key.startswith("defence_") and "defences" in results:
        rows = results["defences"]["per_round"].get("10")
        rec = None if rows is None else rows.get(key[len("defence_"):])
        return None if rec is None else rec["vs_fedavg"]
    if key.startswith("compression_") and "compression" in results:
        rec = results["compression"]["methods"].get(key[len("compression_"):])
        return None if rec is None else rec["vs_fedavg"]
    if key == "grouped_impl" and "grouped_conv" in results:
        return results["grouped_conv"]["vgg_step"]["auto"]["ratio_to_best"]
    if key == "grouped_strategy" and results.get("grouped_conv", {}).get("rounds"):
        return max(b["auto"]["ratio_to_best"]
                   for b in results["grouped_conv"]["rounds"].values())
    if key == "throughput_fedjax" and "throughput" in results:
        r = results["throughput"]
        return r["configs"][f"{r['auto']} (auto)"]["vs_fedjax_style"]
    if key == "throughput_pytorch" and "throughput" in results:
        r = results["throughput"]
        return r["configs"][f"{r['auto']} (auto)"].get("vs_pytorch")
    if key == "auto_vs_naive":
        ratios = [rec["strategies"][rec["auto"]["picks"]]["training_speedup_vs_naive"]
                  for rec in [results.get("mlp")] + list(results.get("vgg", {}).values())
                  if rec]
        if "padding" in results:
            pad = results["padding"]
            ratios.append(pad["configs"][pad["auto"]["picks"]]["training_speedup_vs_naive"])
        if "throughput" in results:
            r = results["throughput"]
            ratios.append(r["configs"][f"{r['auto']} (auto)"]["vs_naive"])
        return min(ratios) if ratios else None
    if key == "auto_vgg9" and "vgg" in results:
        gated = [b for b in results["vgg"].values() if b["gates_auto_target"]]
        return max(b["auto"]["ratio_to_best"] for b in gated) if gated else None
    return None


def evaluate_targets(results: Results) -> List[Dict[str, Any]]:
    """PASS / MISS (or n/a when the section was not run) for each target."""
    out = []
    for name, key, threshold, op in TARGETS:
        value = _target_value(results, key)
        if value is None:
            status = "n/a"
        else:
            ok = value >= threshold if op == ">=" else value <= threshold
            status = "PASS" if ok else "MISS"
        out.append({"name": name, "value": value, "threshold": threshold, "op": op,
                    "status": status})
    return out


# ----------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------

COLUMNS = ("config", "s/round", "eval s", "end-to-end s", "examples/s", "GFLOP/s",
           "% ceiling", "% roofline", "bound", "padding eff", "vs naive (e2e)",
           "vs naive (train)", "compiles warm/timed", "reps")


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _roofline_cells(rec: Dict[str, Any]) -> List[str]:
    """'% roofline' and which side of the ridge the row's work falls on."""
    return [_pct(rec.get("fraction_of_roofline")), rec.get("roofline_bound") or "-"]


def _row(name: str, rec: Dict[str, Any]) -> List[str]:
    def opt(key: str, fmt: str) -> str:
        return format(rec[key], fmt) if rec.get(key) is not None else "-"
    return [name, f"{rec['seconds_per_round']:.3f}", f"{rec['eval_seconds']:.3f}",
            f"{rec['end_to_end_seconds']:.3f}", f"{rec['examples_per_second']:.0f}",
            f"{rec['gflops']:.1f}", f"{100 * rec['fraction_of_ceiling']:.1f}%",
            *_roofline_cells(rec),
            f"{100 * rec['padding_efficiency']:.1f}%", opt("speedup_vs_naive", ".2f"),
            opt("training_speedup_vs_naive", ".2f"),
            f"{rec['compiles_warmup']}/{rec['compiles_timed']}", str(rec["reps"])]


def _strategy_block(title: str, r: Dict[str, Any]) -> tuple:
    """A per-strategy table with what auto picks and the engine-vs-naive agreement."""
    agree = ", ".join(f"{k} {v:.1e}" for k, v in r["agreement_max_rel_diff"].items())
    notes = [_describe(r["workload"]),
             f"auto picks {r['auto']['picks']}; best {r['auto']['best']}; auto/best = "
             f"{r['auto']['ratio_to_best']:.3f}",
             f"engine vs naive averaged model after round 0 (max rel diff): {agree}"]
    rows = _strategy_rows(r["strategies"], r["naive"], r["auto"]["picks"])
    if r.get("fedjax_style"):
        rows.append(_row("fedjax-style loop", r["fedjax_style"]))
    if r.get("bfloat16"):
        rows.append(_row(f"{r['bfloat16']['strategy']} bfloat16", r["bfloat16"]))
        notes.append(f"bfloat16: the model computed in bfloat16 on float32 weights "
                     f"(`models.precision.policy`), its roofline against the bfloat16 "
                     f"matmul rate ({r['bfloat16']['matmul_gflops_bf16']:.1f} GFLOP/s); a "
                     "row, no target")
    return (title, notes, list(COLUMNS), rows)


def _strategy_rows(configs: Dict[str, Dict[str, Any]], naive: Dict[str, Any],
                   auto: str) -> List[List[str]]:
    rows = [_row(f"{k} (auto)" if k == auto else k, v) for k, v in configs.items()]
    return rows + [_row("naive loop", naive)]


def _text_table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def _md_table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _describe(w: Dict[str, Any]) -> str:
    size = (f"{w['client_size_min']}" if w["client_size_min"] == w["client_size_max"] else
            f"{w['client_size_min']}-{w['client_size_max']} (mean {w['client_size_mean']:.0f})")
    return (f"{w['name']}: {w['num_clients']} clients x {size} examples, "
            f"{w['clients_per_round']} per round, B={w['batch_size']}, E={w['epochs']:g}, "
            f"{w['params']:,} params, {w['flops_per_example'] / 1e6:.1f} MFLOP/example "
            f"(training), test set {w['test_examples']}")


def _blocks(results: Results) -> List[tuple]:
    """(title, description lines, header, rows) of every table, in report order."""
    blocks = []
    mm = results["matmul"]
    per_section = mm.get("per_section_gflops", {})
    again = ", ".join(f"{k} {v:.1f}" for k, v in per_section.items())
    lines = [
        f"jitted float32 {mm['size']}x{mm['size']} @ {mm['size']}x{mm['size']}, median of "
        f"{mm['reps']}: {mm['gflops']:.1f} GFLOP/s (best {mm['best_gflops']:.1f})",
        f"re-measured before each section, whose '% ceiling' uses its own: {again or '-'}"]
    roof = results.get("roof")
    if roof:
        bw = ", ".join(f"{k} {v['bandwidth_gbs']:.1f}"
                       for k, v in roof.get("per_section", {}).items())
        lines += [
            f"memory bandwidth, float32 arrays of {roof['stream_mib']} MiB each, GB/s read + "
            f"written: jitted copy {roof['copy_gbs']:.1f}, jitted triad "
            f"{roof['triad_gbs']:.1f}, NumPy triad {roof['numpy_triad_gbs']:.1f}; the best "
            f"triad, {roof['bandwidth_gbs']:.1f}, is the roof's (per section: {bw or '-'}); "
            f"ridge {roof['ridge_flops_per_byte']:.1f} FLOP/byte",
            "% roofline = the least time a row's work takes here, max(XLA FLOPs / matmul "
            "rate, XLA bytes accessed / bandwidth) summed over its timed rounds, over its "
            "measured time; XLA counts every fused op's operands and outputs, an upper bound "
            "on memory traffic (operands that stay in cache count too), so a row above 100% "
            "moved less than XLA counts (`benchmarks/roofline.py`); bound = the side of the "
            "ridge"]
    blocks.append(("Machine roof: matmul ceiling and memory bandwidth", lines, None, None))
    if "mlp" in results:
        blocks.append(_strategy_block("MLP bench", results["mlp"]))
    if "padding" in results:
        r = results["padding"]
        rows = _strategy_rows(r["configs"], r["naive"], r["auto"]["picks"])
        header = list(COLUMNS) + ["expected eff (cohorts)"]
        for row, rec in zip(rows, list(r["configs"].values()) + [r["naive"]]):
            exp = rec.get("expected_padding_efficiency")
            row.append("-" if exp is None else f"{100 * exp:.1f}%")
        blocks.append((f"Padding ({r['dataset']}, Dirichlet alpha={r['alpha']:g})", [
            _describe(r["workload"]),
            "bucketed = clients sorted by step count (library); unbucketed = cohort order; "
            "a single block (G = clients per round) cannot gain from sorting",
            "the naive loop compiles its step anew for every new short-batch size; its timed "
            "rounds include those compilations (compiles column)"], header, rows))
    for key, r in results.get("vgg", {}).items():
        blocks.append(_strategy_block(f"Convnet {key} ({r['model']}, width {r['width']:g})", r))
    if "scaling" in results:
        r = results["scaling"]
        header = ["clients/round", "s/round", "s/client", "per-client vs first", "examples/s",
                  "GFLOP/s", "% ceiling", "% roofline", "bound", "compiles warm/timed",
                  "reps"]
        rows = [[str(p["clients_per_round"]), f"{p['seconds_per_round']:.3f}",
                 f"{p['seconds_per_client']:.4f}", f"{p['per_client_vs_first']:.3f}",
                 f"{p['examples_per_second']:.0f}", f"{p['gflops']:.1f}",
                 f"{100 * p['fraction_of_ceiling']:.1f}%", *_roofline_cells(p),
                 f"{p['compiles_warmup']}/{p['compiles_timed']}", str(p["reps"])]
                for p in r["points"]]
        blocks.append(("Scaling (MLP bench)", [
            f"strategy {r['strategy']} (auto); compiles after warm-up: "
            f"{r['compiles_after_warmup']}"], header, rows))
        if r.get("population"):
            blocks.append(_population_block(r["population"]))
        if r.get("moon"):
            blocks.append(_moon_block(r["moon"]))
    if "profile" in results:
        blocks.append(_profile_block(results))
    if "algorithms" in results:
        blocks.append(_algorithms_block(results))
    if "defences" in results:
        blocks.append(_defences_block(results["defences"]))
    if "compression" in results:
        blocks.append(_compression_block(results["compression"]))
    if "grouped_conv" in results:
        blocks += _grouped_blocks(results["grouped_conv"])
    if "throughput" in results:
        blocks += _throughput_blocks(results["throughput"])
    return blocks


def _population_block(r: Dict[str, Any]) -> tuple:
    def mib(x):
        return "-" if x is None else f"{x:.0f}"
    header = ["K clients", "clients/round", "s/round", "examples/s", "client data MiB",
              "RSS after MiB", "peak RSS MiB", "device in use MiB", "device peak MiB",
              "compiles timed"]
    rows = [[f"{p['num_clients']:,}", str(p["clients_per_round"]),
             f"{p['seconds_per_round']:.3f}", f"{p['examples_per_second']:.0f}",
             f"{p['client_data_mib']:.2f}", mib(p.get("rss_mib")), mib(p["peak_rss_mib"]),
             mib(p.get("device_in_use_mib")), mib(p["device_peak_mib"]),
             str(p["compiles_timed"])] for p in r["points"]]
    return ("Population (stateless FedAvg, MLP bench network)", [
        f"clients of {r['examples_per_client']} examples each from one pool of "
        f"{r['pool']:,} (one local step each), strategy {r['strategy']} (auto); memory "
        "after each point with its round state dropped and its workload kept, and the "
        "peaks so far (K in increasing order)"], header, rows)


def _moon_block(r: Dict[str, Any]) -> tuple:
    header = ["K clients", "clients/round", "rounds", "state MiB/client", "all states GiB",
              "host memory GiB", "on disk GiB", "peak RSS GiB", "wall s", "test accuracy"]
    rows = [[f"{r['num_clients']:,}", str(r["clients_per_round"]), str(r["rounds"]),
             f"{r['state_mib_per_client']:.1f}", f"{r['all_states_gib']:.1f}",
             f"{r['host_memory_gib']:.1f}", f"{r['disk_gib']:.1f}",
             f"{r['peak_rss_gib']:.2f}", f"{r['wall_seconds']:.0f}",
             f"{100 * r['test_accuracy']:.2f}%"]]
    return ("MOON over many clients (client states on disk)", [
        "Fashion-MNIST, Dirichlet alpha=0.1, the MLP bench network, E=2, B=10, one previous "
        "model per client; states placed by size (execution.client_states=auto); clients that never "
        "trained share the initial state; peak RSS of the run's own process"],
        header, rows)


def _throughput_blocks(r: Dict[str, Any]) -> List[tuple]:
    w = r["workload"]
    torch_row = any("vs_pytorch" in c for c in r["configs"].values())
    header = ["config", "s/round", "examples/s", "GFLOP/s", "% ceiling", "% roofline",
              "bound", "vs FedJAX-style", "vs naive", *(["vs PyTorch"] if torch_row else []),
              "compiles warm/timed", "reps"]
    rows = [[k, f"{c['seconds_per_round']:.3f}", f"{c['examples_per_second']:.0f}",
             f"{c['gflops']:.1f}", f"{100 * c['fraction_of_ceiling']:.1f}%",
             *_roofline_cells(c),
             f"{c['vs_fedjax_style']:.3f}", f"{c['vs_naive']:.3f}",
             *([f"{c['vs_pytorch']:.3f}"] if torch_row else []),
             f"{c['compiles_warmup']}/{c['compiles_timed']}", str(c["reps"])]
            for k, c in r["configs"].items()]
    agree = ", ".join(f"{k} {v:.1e}" for k, v in r["agreement_max_rel_diff"].items())
    notes = [f"{w['name']}: {w['num_clients']} clients x {w['client_size_min']}-"
             f"{w['client_size_max']} (mean {w['client_size_mean']:.0f}) examples, "
             f"Dirichlet alpha={w['alpha']:g} by class, {w['clients_per_round']} per round "
             f"(the same cohorts for every row), B={w['batch_size']}, E={w['epochs']}, SGD "
             f"lr {w['learning_rate']:g} momentum {w['momentum']:g}, {w['params']:,} params, "
             "FedAvg weighted by examples",
             "timed rounds interleaved across rows (each round starting with the next "
             "row); examples/s = real training examples "
             "(sample-epochs) per second of training; `vs` columns are this row's "
             "throughput over the baseline's, measured in this run",
             "FedJAX-style = FedJAX's jit backend (host-side batches, one dispatch per step, "
             "`benchmarks/fedjax_style.py`); naive = `benchmarks/naive.py`; PyTorch = "
             "PFLlib's client loop on the CPU (`benchmarks/pytorch_style.py`, torch "
             + (f"{r['torch_version']}, {r['torch_threads']} threads)" if torch_row else
                "not installed here: no row)"),
             f"global model after round 0 against the engine's (max rel diff): {agree}"]
    blocks = [("FedJAX workload (Fashion-MNIST, 20 clients)", notes, header, rows)]
    if r.get("startup"):
        header = ["run", "imports s", "data s", "build s", "first round s",
                  "to first round s", "compiles", "compile s", "process s"]
        rows = [[k, f"{v['imports_s']:.2f}", f"{v['data_s']:.2f}", f"{v['build_s']:.2f}",
                 f"{v['first_round_s']:.2f}", f"{v['to_first_round_s']:.2f}",
                 str(v["compiles"]), f"{v['compile_s']:.2f}", f"{v['process_s']:.2f}"]
                for k, v in r["startup"].items()]
        blocks.append(("Start-up on the FedJAX workload", [
            "a fresh process per row, from its start to the end of its first trained round "
            "(the round's training included); `process s` adds interpreter start and exit",
            "engine rows share one persistent compilation cache, empty before the cold "
            "run: the warm row is a second run of the same job"], header, rows))
    return blocks


def _impl_rows(label: str, impls: Dict[str, Dict[str, Any]], auto: str) -> List[List[str]]:
    base = impls[auto]["seconds"]
    return [[label, f"{k} (auto)" if k == auto else k, f"{1e3 * v['seconds']:.2f}",
             f"{v['gflops']:.1f}", f"{100 * v['fraction_of_ceiling']:.1f}%",
             f"{v['seconds'] / base:.2f}", str(v["reps"])] for k, v in impls.items()]


def _grouped_blocks(r: Dict[str, Any]) -> List[tuple]:
    """Grouped conv layers and step per implementation; grouped rounds per strategy."""
    header = ["shape", "implementation", "ms", "GFLOP/s", "% ceiling", "vs auto", "reps"]
    rows, notes = [], []
    for layer in r["layers"]:
        rows += _impl_rows(layer["key"], layer["impls"], layer["auto"]["picks"])
        d = layer["dense"]
        rows.append([layer["key"].replace(f"G{layer['groups']}", "G1"), "dense reference",
                     f"{1e3 * d['seconds']:.2f}", f"{d['gflops']:.1f}",
                     f"{100 * d['fraction_of_ceiling']:.1f}%", "-", str(d["reps"])])
        a = layer["auto"]
        notes.append(f"{layer['key']}: auto picks {a['picks']} (fastest {a['best']}, "
                     f"auto/fastest {a['ratio_to_best']:.2f}); slowest {a['slowest']} is "
                     f"{a['slowest_over_auto']:.1f}x auto")
    blocks = [(f"Grouped conv layers, forward + backward ({r['backend']})", [
        "one conv's forward and its input and kernel gradients; GFLOP/s counts the grouped "
        "conv's real FLOPs (3 x 2 x B x H x W x k^2 x C/G x C), the dense reference its "
        "own (G times more)"] + notes, header, rows)]
    s = r["vgg_step"]
    a = s["auto"]
    blocks.append(("Grouped VGG9 local step per conv implementation", [
        f"Fed2 VGG9 width {s['width']:g}, input {'x'.join(map(str, s['input_shape']))}, "
        f"G={s['groups']} over the last {s['depth']} weight layers, B={s['batch_size']}, "
        f"{s['params']:,} params; one momentum-SGD step (`local.sgd_step`), "
        f"{s['flops'] / 1e6:.1f} MFLOP (3 x XLA's forward count)",
        f"auto picks {a['picks']} (fastest {a['best']}, auto/fastest "
        f"{a['ratio_to_best']:.2f}); slowest {a['slowest']} is "
        f"{a['slowest_over_auto']:.1f}x auto"], header[1:],
        [row[1:] for row in _impl_rows("", s["impls"], a["picks"])]))
    if r["rounds"]:
        rows, notes = [], []
        for key, b in r["rounds"].items():
            auto = b["auto"]["picks"]
            for name, rec in b["strategies"].items():
                rows.append([key, f"{name} (auto)" if name == auto else name,
                             f"{rec['seconds_per_round']:.3f}", f"{rec['gflops']:.1f}",
                             f"{100 * rec['fraction_of_ceiling']:.1f}%",
                             *_roofline_cells(rec),
                             f"{rec['compiles_warmup']}/{rec['compiles_timed']}",
                             str(rec["reps"])])
            impls = ", ".join(b["conv_impls"]) or "no G-group convs"
            notes.append(f"{_describe(b['workload'])}; grouped convs: {impls}; auto picks "
                         f"{auto}, best {b['auto']['best']}, auto/best "
                         f"{b['auto']['ratio_to_best']:.3f}")
        blocks.append(("Execution strategy for grouped models", notes,
                       ["model", "strategy", "s/round", "GFLOP/s", "% ceiling",
                        "% roofline", "bound", "compiles warm/timed", "reps"], rows))
    return blocks


PROFILE_PARTS = {
    "ceiling": "jitted float32 2048^2 matmul (the reference)",
    "shapes": "the step's own matmuls at their shapes (forward, input and weight grads)",
    "grad": "forward + backward of the MLP",
    "update": "momentum SGD update alone (not in place)",
    "stream": "memory stream over parameter-sized arrays (read 2, write 1, in place)",
    "step": "the library's local step (`sgd_step`), standalone call",
    "floor": "shapes + the update's 5 parameter passes at stream bandwidth",
}


def _algorithms_block(results: Results) -> tuple:
    r = results["algorithms"]
    header = ["algorithm", "s/round", "vs FedAvg", "% roofline", "client state (MiB, all K)",
              "server state (MiB)"]
    rows = [[name, f"{a['seconds_per_round']:.3f}", f"{a['vs_fedavg']:.2f}x",
             _pct(a.get("fraction_of_roofline")),
             f"{a['client_state_mib']:.1f}", f"{a['server_state_mib']:.1f}"]
            for name, a in r["algorithms"].items()]
    med = r["median_aggregation"]
    rows.append(["fedavg + median", f"{med['seconds_per_round']:.3f}",
                 f"{med['vs_fedavg']:.2f}x", "-",
                 f"stacked outputs {med['stacked_outputs_mib']:.1f}", ""])
    for n_sf, a in r.get("shuffled", {}).items():
        rows.append([f"fedavg + Alg. 2 shuffling (N_sf {n_sf}, P_sf 0.1)",
                     f"{a['seconds_per_round']:.3f}", f"{a['vs_fedavg']:.2f}x", "-", "", ""])
    tuned = r.get("fine_tuned")
    if tuned:
        rows.append([f"FedAvg-C evaluation: all {tuned['clients']} clients fine-tune 1 "
                     f"epoch", f"{tuned['seconds']:.3f}", f"{tuned['vs_fedavg_round']:.2f}x",
                     "-", "", ""])
    lines = [_describe(r["workload"]),
             f"strategy {r['strategy']} (auto); training and aggregation, no evaluation; "
             "each algorithm with its default options"]
    d = r.get("drivers")
    if d and d["algorithms"]:
        fa = d["fedavg"]
        lines.append(f"Algorithms with their own driver, against FedAvg on the same network "
                     f"(hidden {tuple(d['hidden'])}, no PANs): FedAvg "
                     f"{fa['seconds_per_round']:.3f} s/round, {fa['upload_mib']:.1f} / "
                     f"{fa['download_mib']:.1f} MiB up / down per round")
        for name, a in d["algorithms"].items():
            down = ("" if a.get("download_mib") is None
                    else f" / {a['download_mib']:.1f} MiB down")
            grown = (f", hidden widths {tuple(a['widths'])}" if a.get("widths") else "")
            lines.append(f"  {name}: {a['seconds_per_round']:.2f} s/round "
                         f"({a['vs_fedavg']:.1f}x FedAvg; {a['compiles_timed']} compilations, "
                         f"{a['compile_s_timed']:.1f} s, in the timed round), "
                         f"{a['upload_mib']:.1f} MiB up{down}{grown}")
    return "Algorithms on the MLP bench", lines, header, rows


def _defences_block(r: Dict[str, Any]) -> tuple:
    sizes = list(r["per_round"])
    header = ["rule"] + [f"{m} clients: s/round" for m in sizes] + [
        f"{m} clients: vs FedAvg" for m in sizes]
    names = list(r["per_round"][sizes[0]])
    rows = [[name] + [f"{r['per_round'][m][name]['seconds_per_round']:.3f}" for m in sizes]
            + [f"{r['per_round'][m][name]['vs_fedavg']:.2f}x" for m in sizes]
            for name in names]
    return ("Aggregation rules and stragglers on the MLP bench",
            [_describe(r["workload"]), "training and aggregation, no evaluation; Multi-Krum "
             "and Zeno told f = b = a fifth of the round; SageFlow and Zeno score every "
             "model on 1,000 server-side examples"], header, rows)


def _compression_block(r: Dict[str, Any]) -> tuple:
    header = ["method", "s/round", "vs FedAvg", "% roofline", "MiB up", "MiB down"]
    rows = [[name, f"{rec['seconds_per_round']:.3f}", f"{rec['vs_fedavg']:.2f}x",
             _pct(rec.get("fraction_of_roofline")),
             f"{rec['upload_mib']:.2f}", f"{rec['download_mib']:.2f}"]
            for name, rec in r["methods"].items()]
    return ("Compression and DP-FedAvg on the MLP bench",
            [_describe(r["workload"]), "training, the transform and aggregation, no "
             "evaluation; bytes of one round, counted from the wire format"], header, rows)


def _profile_block(results: Results) -> tuple:
    r = results["profile"]
    rows = []
    for name, rec in r["rows"].items():
        rows.append([name, f"{1e3 * rec['seconds']:.2f}",
                     "-" if "gflops" not in rec else f"{rec['gflops']:.1f}",
                     "-" if "fraction_of_ceiling" not in rec
                     else f"{100 * rec['fraction_of_ceiling']:.1f}%",
                     "-" if "gb_per_s" not in rec else f"{rec['gb_per_s']:.1f}",
                     "-" if "xla_bytes" not in rec else f"{rec['xla_bytes'] / 2**20:.1f}",
                     *_roofline_cells(rec), PROFILE_PARTS.get(name, "")])
    floor = r["rows"]["floor"]["fraction_of_ceiling"]
    notes = [f"one local step of the MLP bench (B={r['batch_size']}) taken apart; FLOPs as "
             "in the MLP bench (6 x params per example)",
             f"floor: a step cannot beat {100 * floor:.1f}% of the ceiling on this machine "
             "(its matmuls run below the 2048^2 rate at these shapes and the optimiser "
             "update is memory-bound)"]
    if "mlp" in results:
        m = results["mlp"]
        rec = m["strategies"][m["auto"]["picks"]]
        notes.append(f"the MLP bench's `auto` strategy ran at "
                     f"{100 * rec['fraction_of_ceiling']:.1f}% of its ceiling, "
                     f"{rec['fraction_of_ceiling'] / floor:.2f} of this floor")
    rp = r.get("round")
    if rp:
        notes += [
            f"one MLP-bench round profiled (`python -m benchmarks.profile_step --trace-round "
            f"DIR`), strategy {rp['strategy']}, {rp['clients_per_round']} clients: "
            f"{rp['round_s']:.3f} s, of which {rp['executor_s']:.3f} s in the executor "
            f"(local training) and {rp['outside_executor_s']:.3f} s outside it; "
            f"{rp['compiles']} compilations; padding efficiency "
            f"{100 * rp['padding_efficiency']:.1f}%",
            f"under the profiler: {rp['traced_round_s']:.3f} s, some XLA program running "
            f"{rp['xla_busy_s']:.3f} s (summed over threads {rp['xla_thread_s']:.3f} s), none "
            f"running (host work, dispatch, syncs) {rp['host_only_s']:.3f} s; engine "
            "functions by inclusive time: " + ", ".join(
                f"{o['name']} {o['seconds']:.3f} s x{o['calls']}"
                for o in rp["engine_functions"][:5])]
    header = ["part", "ms", "GFLOP/s", "% ceiling", "GB/s", "XLA MiB", "% roofline", "bound",
              "what"]
    return ("What stands between the MLP step and the matmul ceiling", notes, header, rows)


def _summary_lines(results: Results) -> List[str]:
    mem, comp = results["memory"], results["compiles"]
    device = ("" if mem.get("device_peak_mib") is None else
              f"; device peak {mem['device_peak_mib']:.0f} MiB")
    return [f"compilations: {comp['count']} in {comp['seconds']:.1f} s; peak RSS "
            f"{mem['peak_rss_mib']:.0f} MiB{device}; suite wall time "
            f"{results['total_seconds']:.0f} s"]


def _target_lines(results: Results) -> List[str]:
    lines = []
    for t in results["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"{t['status']:<4}  {t['name']}: {value} ({t['op']} {t['threshold']:g})")
    return lines


def format_text(results: Results) -> str:
    """The table printed at the end of a run."""
    out = []
    for title, lines, header, rows in _blocks(results):
        out += [f"== {title}"] + [f"   {line}" for line in lines]
        if header:
            out.append(_text_table(header, rows))
        out.append("")
    out += ["== Targets"] + _target_lines(results) + [""] + _summary_lines(results)
    return "\n".join(out)


def _machine_lines(meta: Dict[str, Any]) -> List[str]:
    git = meta.get("git")
    commit = "unknown" if not git else git["commit"] + (" (uncommitted changes)"
                                                          if git["dirty"] else "")
    load = lambda v: "-" if v is None else ", ".join(f"{x:.2f}" for x in v)  # noqa: E731
    return [f"- date: {meta['date']}", f"- commit: {commit}",
            f"- machine: {meta['platform']}; {meta['cpu']}; {meta['cpu_count']} cores",
            f"- backend: {meta['backend']} ({meta['device_kind']}, {len(meta['devices'])} "
            f"device(s)); jax {meta['jax']}, jaxlib {meta['jaxlib']}, flax {meta['flax']}, "
            f"optax {meta['optax']}, python {meta['python']}",
            f"- load average (1/5/15 min) at start: {load(meta['load_average_start'])}; at "
            f"end: {load(meta.get('load_average_end'))}"]


def format_markdown(results: Results, command: str = "") -> str:
    """RESULTS.md: machine, date, commit, every table, the targets."""
    s = results["settings"]
    out = ["# Benchmark results", "",
           f"Suite `{s['suite']}`{' (quick sizes)' if s['quick'] else ''}, {s['warmup']} "
           f"warm-up round(s), then the median of up to {s['reps']} timed rounds per "
           "configuration (fewer where noted in `reps`). Generated by "
           f"`{command or 'python -m benchmarks.run'}`; times are seconds per federated "
           "round, `end-to-end` includes evaluating the global model on the test set, "
           "`vs naive` is the naive per-batch loop's time over this row's, measured in the "
           "same run.", ""]
    out += _machine_lines(results["meta"]) + [""]
    out += ["## Targets", "", _md_table(["status", "target", "measured"], [
        [t["status"], t["name"], "-" if t["value"] is None else f"{t['value']:.3f}"]
        for t in results["targets"]]), ""]
    for title, lines, header, rows in _blocks(results):
        out += [f"## {title}", ""] + [f"- {line}" for line in lines] + [""]
        if header:
            out += [_md_table(header, rows), ""]
    out += ["## Totals", ""] + _summary_lines(results) + [""]
    return "\n".join(out)
