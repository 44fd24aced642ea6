"""JSON every consumer parses: a value that is not a finite number is written as ``null``.

Python's ``json`` writes ``NaN`` and ``Infinity`` by default, which is not JSON: JavaScript's
``JSON.parse``, ``jq`` and most other parsers refuse the whole file. Every JSON file and JSON tag
imageops writes goes through :func:`dumps` (files through ``models.atomic.write_json``). In
``models/``, the bottom layer, so every layer may use it.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, infinity) replaced by None, in lists,
    tuples and dicts at any depth; numpy scalars become Python numbers."""
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        value = value.item()  # a numpy scalar (np.float64 is a float, np.float32 is not)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`finite` of ``value``, refusing anything that would still write
    ``NaN`` or ``Infinity``."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
