"""FLChain's ledger audit from the command line: `ledger.verify` under FLChain's update rule.

`python -m fedjax_pan.algorithms.robust.flchain_cli WORKDIR` verifies the ledger of the
FLChain run in WORKDIR (`USAGE`). --anchor FILE: the anchor the run printed (or a copy of
its summary.json) that the run's owner kept; without it, the anchor in WORKDIR/summary.json
is used, with a note that it only binds a folder nobody else wrote. --validators: the
validators' fingerprint, or a JSON file with their public keys (a list), an anchor or a
summary.json. Exit 0 verified, 1 a fault named in one line, 2 bad input (or a ledger format
this verifier does not read).

(`fedjax_pan.algorithms.robust.ledger`'s docstring has what the audit checks and the formats.)
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Any, Dict, List, Optional, Tuple

from fedjax_pan.algorithms.robust import ledger
from fedjax_pan.algorithms.robust import flchain
from fedjax_pan.algorithms import server_optimizer


def verify(workdir: str, **options: Any) -> Dict[str, Any]:
    """`ledger.verify` of the FLChain run in `workdir` (`options`: its anchor, validators,
    progress), each channel replayed under the rule its genesis names."""
    return ledger.verify(workdir, flchain.audit(server_optimizer), **options)


USAGE = ("usage: python -m fedjax_pan.algorithms.robust.flchain_cli WORKDIR [--anchor FILE] "
         "[--validators sha256:HEX|FILE] (verifies the run's ledger)")


def _arguments(argv: List[str]) -> Tuple[str, Optional[str], Optional[str]]:
    """(workdir, anchor file, validators) from the command line; ValueError saying why not."""
    workdir, options = None, {"--anchor": None, "--validators": None}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in options:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} needs a value")
                i, value = i + 1, argv[i + 1]
            if options[name] is not None:
                raise ValueError(f"{name} given twice")
            options[name] = value
        elif arg.startswith("-") or workdir is not None:
            raise ValueError(f"unexpected argument {arg!r}")
        else:
            workdir = arg
        i += 1
    if workdir is None:
        raise ValueError("expected one WORKDIR")
    return workdir, options["--anchor"], options["--validators"]


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(f"{textwrap.fill(USAGE, width=92, subsequent_indent='    ')}\n\n{__doc__ or ''}"
              .rstrip())
        return 0
    # Bad input (exit 2) is a wrong command line, a folder without a ledger, an unreadable
    # anchor or a ledger of another format; a ledger that does not verify exits 1.
    try:
        workdir, anchor_file, validators_arg = _arguments(argv)
    except ValueError as e:
        print(f"error: {e}, got {argv}; {USAGE}", file=sys.stderr)
        return 2
    if not os.path.isdir(os.path.join(workdir, "ledger")):
        print(f"error: {workdir!r} holds no ledger (not an FLChain run's workdir)",
              file=sys.stderr)
        return 2
    summary = os.path.join(workdir, "summary.json")
    try:
        validators = None if validators_arg is None else ledger.read_validators(validators_arg)
        if anchor_file is not None:
            anchor_obj = ledger.read_anchor(anchor_file)
        elif os.path.isfile(summary):
            with open(summary) as f:
                found = json.load(f)
            found = found.get("ledger_anchor") if isinstance(found, dict) else None
            anchor_obj = None if found is None else ledger.check_anchor(found)
        else:
            anchor_obj = None
    except (OSError, ValueError) as e:
        print(f"error: cannot read the anchor or validators: {e}", file=sys.stderr)
        return 2
    try:
        counts = verify(workdir, anchor=anchor_obj, validators=validators, progress=True)
    except ledger.LedgerFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ledger.LedgerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    what = (f"{counts['channels']} channel(s), {counts['blocks']} blocks, "
            f"{counts['transactions']} transactions")
    if anchor_obj is not None:
        heads = ", ".join(f"channel {c['channel']} at block {c['height']}"
                          for c in anchor_obj["channels"])
        print(f"ledger of {workdir} verified against the anchor in "
              f"{anchor_file or summary}: {what}; validators sha256 "
              f"{anchor_obj['validators_sha256'][:16]}..., heads {heads}")
        if anchor_file is None:
            print("note: that anchor lies in the folder it vouches for, so whoever can "
                  "rewrite the ledger can rewrite it too: it catches accidents, not forgery; "
                  "pass --anchor with the copy the run's owner kept")
    else:
        print(f"ledger of {workdir} verified for internal consistency only: {what}"
              + (f"; its validators are the expected ones (sha256 {validators[:16]}...)"
                 if validators else ""))
        print(f"note: no anchor given and none in {summary}: a history rewritten and "
              f"re-signed by whoever holds the run's keys, or cut short, would pass; pass "
              f"--anchor FILE (the anchor the run printed, or a copy of its summary.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
