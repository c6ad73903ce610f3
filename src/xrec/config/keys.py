"""Reading config.json values: type checks and messages that name the key. No torch import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config key {name!r}: got {value!r}, expected an integer >= 1")


def get_key(raw: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """`raw[key]` (None or absent: `default`), checked to be a `kind` (bool, int or float)."""
    value = raw.get(key, default)
    if value is None:
        value = default
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key {key!r}: got {value!r}, expected true or false")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config key {key!r}: got {value!r}, expected an integer")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key {key!r}: got {value!r}, expected a number")
        value = float(value)
    return value


def dtype_name(value: Any) -> str:
    aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
               "half": "float16"}
    name = aliases.get(str(value), str(value))
    if name not in DTYPES:
        raise ValueError(f"config key 'torch_dtype': got {value!r}, allowed: {DTYPES}")
    return name


def read_json(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict; ValueError naming the file when it is missing or not an object."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw
