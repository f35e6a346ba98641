"""A choice's shape, decided once for every path (the Python API, the handle wire, the HTTP formatter).

A position of `SINGLE_POSITIONS` (completion_end, prompt_end) gives a choice one row, 1-D: `[D]` (a
head's outputs: one object); any other position several, `[n, D]` (a list). `several` is the one
decision, `squeeze` the one place it shapes rows.
"""

from __future__ import annotations

from typing import Any

from hidden_states.params import SINGLE_POSITIONS


def several(position: Any) -> bool:
    """Whether `position` gives a choice several rows ([n, D]) rather than one vector ([D])."""
    return position not in SINGLE_POSITIONS


def squeeze(rows: Any, multi: bool, empty: Any = None) -> Any:
    """Rows in position order as a choice carries them: all of them for several positions; else the
    one row (`empty` when there is none)."""
    if multi:
        return rows
    return rows[0] if len(rows) else empty
