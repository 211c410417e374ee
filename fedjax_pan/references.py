"""What a method is checked against: the paper, the code it follows, and where it departs.

Every algorithm entry, aggregation rule, attack, upload transform and privacy mechanism
declares one `Reference` (`fedjax_pan.fidelity` gathers them into docs/FIDELITY.md), and a
test marked `@pytest.mark.reference(kind, name)` checks it against that reference written
independently (NumPy, or the formula solved by hand) on a tiny case.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

# The code bases methods are read against, at the commits they were read at.
PFLLIB = "TsingZ0/PFLlib@d832e76f6a23b833038949ec1e4fdefe63a4d350"
SIREN = "AISIGSJTU/Siren@1cd64cfc69b2d2e5a6b8a59bc0ec13d42e13abca"
SAGEFLOW = "savertm/Sageflow@e2b42040ddb74a0a19e2d065b54ca60f0b139fbe"


class Reference(NamedTuple):
    """A method's reference. `paper`: authors, title or venue, year, and the equation or
    algorithm followed; `code`: 'owner/repo@commit: path' of the code followed where the
    paper leaves a choice open (None where no code is followed); `departures`: one line
    each, what differs from the reference and why (empty: equal to the reference)."""

    paper: str
    code: Optional[str]
    departures: Tuple[str, ...]


def pfllib(*paths: str) -> str:
    """PFLlib's files at the commit read: 'TsingZ0/PFLlib@<commit>: a.py, b.py'."""
    return f"{PFLLIB}: " + ", ".join(f"system/flcore/{p}" for p in paths)


def check(reference: Reference, where: str) -> None:
    """Raises ValueError naming `where` for a reference that says nothing checkable."""
    if not isinstance(reference, Reference):
        raise ValueError(f"{where}: reference must be a fedjax_pan.references.Reference, "
                         f"got {type(reference).__name__}")
    if not reference.paper.strip():
        raise ValueError(f"{where}: reference.paper is empty")
    if reference.code is not None and not reference.code.strip():
        raise ValueError(f"{where}: reference.code is empty (None where no code is followed)")
    if not isinstance(reference.departures, tuple) or not all(
            isinstance(d, str) and d.strip() for d in reference.departures):
        raise ValueError(f"{where}: reference.departures must be a tuple of non-empty lines")


__all__ = ["PFLLIB", "SIREN", "SAGEFLOW", "Reference", "pfllib", "check"]
