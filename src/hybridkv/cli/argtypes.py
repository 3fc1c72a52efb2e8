"""Value parsers for ``argparse`` options: an explicit empty, zero, negative or non-finite
value is an error naming what was typed, never a silent default.

Each parser raises ``argparse.ArgumentTypeError``; the CLI prints it as one line
(``hybridkv replay: error: argument --max-running: must be an integer >= 1, got '0'``).

>>> positive_int("16"), non_negative_int("0"), non_empty_str("gemma3-bench")
(16, 0, 'gemma3-bench')
>>> positive_int("0")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be an integer >= 1, got '0'
>>> non_negative_float("nan")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be a finite number >= 0, got 'nan'
"""

from __future__ import annotations

import argparse
import math

MAX_INT_DIGITS = 30
"""Longest integer an option accepts (far beyond any pool or token count; a 4,300-digit
value would otherwise reach Python's int-string limit)."""


def _int(text: str, minimum: int) -> int:
    stripped = text.strip()
    if len(stripped) > MAX_INT_DIGITS:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= {minimum} of at most {MAX_INT_DIGITS} digits, "
            f"got {len(stripped)} characters")
    try:
        value = int(stripped)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer ``>= 1`` (counts, sizes, budgets)."""
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    """An integer ``>= 0`` (``--limit 0`` keeps no request; seeds)."""
    return _int(text, 0)


def non_negative_float(text: str) -> float:
    """A finite number ``>= 0`` (tolerances: ``nan`` would make every comparison pass)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a finite number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number ``> 0`` (rates, time scales).

    >>> positive_float("0.5")
    0.5
    >>> positive_float("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a finite number > 0, got '0'
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_empty_str(text: str) -> str:
    """A string with something in it (``--trace ''`` must not mean "no trace")."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


__all__ = ["non_empty_str", "non_negative_float", "non_negative_int", "positive_float",
           "positive_int"]
