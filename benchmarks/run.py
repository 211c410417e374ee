"""Command line: `python -m benchmarks.run --suite cpu --out DIR [--quick] [--only ...]`.

Writes DIR/results.json and DIR/RESULTS.md and prints the table with the targets;
`--write-results` also copies the markdown to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from typing import Any, List, Optional, Sequence

from benchmarks import report, suites

RESULTS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def _sections(text: str) -> List[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(suites.SECTIONS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown}; choose from {','.join(suites.SECTIONS)}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("cpu", "gpu"), default="cpu",
                   help="gpu adds 1000 clients per round to scaling (default: cpu)")
    p.add_argument("--out", required=True, help="directory for results.json and RESULTS.md")
    p.add_argument("--quick", action="store_true", help="tiny sizes (for tests), seconds")
    p.add_argument("--only", type=_sections, default=list(suites.SECTIONS),
                   help=f"comma-separated sections (default: {','.join(suites.SECTIONS)}); "
                        "the matmul ceiling always runs")
    p.add_argument("--reps", type=_positive, default=None,
                   help="timed rounds per configuration (default: 3, quick: 2; the naive "
                        "loop, padding and scaling use at most 2)")
    p.add_argument("--write-results", action="store_true",
                   help=f"also write {os.path.relpath(RESULTS_MD)}")
    return p.parse_args(argv)


def _clean(tree: Any) -> Any:
    # JSON has no NaN/inf: a figure that could not be measured becomes null.
    if isinstance(tree, dict):
        return {str(k): _clean(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_clean(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    if hasattr(tree, "item") and getattr(tree, "ndim", None) == 0:  # numpy scalars
        return _clean(tree.item())
    return tree


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    settings = suites.make_settings(args.suite, args.quick, args.reps)
    results = suites.run_suite(settings, args.only)
    results["targets"] = report.evaluate_targets(results)
    results = _clean(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    command = "python -m benchmarks.run " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    markdown = report.format_markdown(results, command)
    paths = [os.path.join(args.out, "RESULTS.md")] + ([RESULTS_MD] if args.write_results
                                                       else [])
    for path in paths:
        with open(path, "w") as f:
            f.write(markdown)
    print(report.format_text(results))
    print(f"\nwrote {os.path.join(args.out, 'results.json')}, " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
