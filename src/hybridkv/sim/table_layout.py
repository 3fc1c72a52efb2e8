"""The terminal tables' shared layout: a report fits an 80-column terminal, numbers whole.

Every report (``replay``, ``sweep``, ``cluster``) prints a *default* table of the few
columns a user decides on, and with ``--detail`` more tables of the rest; the JSON keeps
every field. The layout keeps rows on one line:

- no vertical rules and no outer edge (``box.SIMPLE_HEAD``): 3 characters between columns,
  none outside, so six columns cost 15 characters of frame instead of 19;
- numeric columns never wrap (``no_wrap``); a label column (a policy or router name) is the
  one that folds when a label alone is wider than the terminal allows, so a number is never
  cut to ``52.0…``;
- a value constant over a table (the ceiling of a trace on a model) goes in its title.

Worked example: the default replay table of the six core policies is ``policy`` (16 with
the best-mark) + ``hit rate`` (8) + ``bound`` (6) + ``largest miss`` (13) + ``wall s`` (6)
= 49 characters of text and 4 × 3 of frame: 61 columns.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from rich import box
from rich.table import Table

from hybridkv.sim.misses import MISS_CAUSES

CAUSE_LABELS = {"cold": "cold", "evicted": "evicted", "tail": "tail", "alignment": "align",
                "admission": "admit", "host_evicted": "host evicted"}
"""The miss causes' column labels (``hybridkv replay --help`` explains them)."""


LABEL_MIN_WIDTH = 8
"""The narrowest a label column gets when a table is wider than the terminal (rich would
otherwise squeeze it to nothing)."""


def report_table(title: str, columns: Sequence[str], *,
                 labels: Collection[str] = ()) -> Table:
    """A table with ``columns``; those in ``labels`` are left-aligned and may fold, the
    others (numbers) are right-aligned and never wrap.

    >>> table = report_table("t", ["policy", "hit rate"], labels={"policy"})
    >>> [(c.header, c.justify, c.no_wrap) for c in table.columns]
    [('policy', 'left', False), ('hit rate', 'right', True)]
    """
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False)
    for name in columns:
        is_label = name in labels
        table.add_column(name, justify="left" if is_label else "right",
                         no_wrap=not is_label, overflow="fold",
                         min_width=LABEL_MIN_WIDTH if is_label else None)
    return table


def largest_miss(shares: Mapping[str, float]) -> str:
    """The miss cause with the largest share of the missed tokens, with that share (the
    first in ``MISS_CAUSES`` order on a tie; ``none`` when nothing was missed).

    >>> largest_miss({"cold": 0.359, "evicted": 0.024, "tail": 0.617, "alignment": 0.0,
    ...               "admission": 0.0})
    'tail 61.7%'
    >>> largest_miss({cause: 0.0 for cause in MISS_CAUSES})
    'none'
    """
    cause = max(MISS_CAUSES, key=lambda c: shares.get(c, 0.0))
    share = shares.get(cause, 0.0)
    return "none" if share <= 0.0 else f"{CAUSE_LABELS[cause]} {100 * share:.1f}%"


def percent(value: float | None) -> str:
    """A rate as a percentage with two decimals (``n/a`` when unknown).

    >>> percent(0.52036), percent(None)
    ('52.04%', 'n/a')
    """
    return "n/a" if value is None else f"{100 * value:.2f}%"


__all__ = ["CAUSE_LABELS", "LABEL_MIN_WIDTH", "largest_miss", "percent", "report_table",
           "seconds"]


def seconds(value: float) -> str:
    """A duration for a table cell.

    >>> seconds(0.0421), seconds(12.345), seconds(4321.0)
    ('42 ms', '12.3 s', '4,321 s')
    """
    if value < 1:
        return f"{value * 1e3:.0f} ms"
    return f"{value:.1f} s" if value < 100 else f"{value:,.0f} s"
