"""Checks of single metadata values (a config.json's fields, a GGUF's keys): each
bad value a ValueError naming the file and the field, so that a corrupt file is
refused before anything is allocated for it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def positive_int(value: Any, field: str, path: str) -> int:
    """`value` as an int >= 1, else a ValueError naming the file and field."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{path}: {field}={value!r} is invalid; it must be an integer >= 1")
    return int(value)


def positive_float(value: Any, field: str, path: str) -> float:
    """`value` as a finite float > 0, else a ValueError naming the file and field."""
    ok = not isinstance(value, bool) and isinstance(value, int | float | np.number)
    if not ok or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{path}: {field}={value!r} is invalid; it must be a finite number > 0")
    return float(value)
