"""Reading config.json values: type checks and messages that name the key. No torch import."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from xrec.utils.files import FileRefused, read_regular_file

DTYPES = ("float32", "bfloat16", "float16")
SILU_NAMES = ("silu", "swish")   # one activation under two names (transformers' ACT2FN)
MAX_CONFIG_BYTES = 16 << 20   # a config.json is a few KiB


# Layer and expert counts past these are typos: the deepest public models have under 130
# layers and 512 experts, and a model is built module by module before its checkpoint is
# matched (20,000 layers took a minute and 1.3 GB on the meta device; 10**8 ran out of memory).
MAX_LAYERS = 1024
MAX_EXPERTS = 16384
# Widths (hidden and feed-forward sizes, heads, head dims, buckets) past 2^20 are typos too (public
# models stay under 60,000), and a vocabulary past 2^31 - 1 holds ids a catalog cannot (int32):
# with them every weight's byte count fits an int64. A width of 2^62 failed inside torch while
# the model was built ("Storage size calculation overflowed"), not naming the key.
MAX_WIDTH = 1 << 20
MAX_VOCAB = (1 << 31) - 1


def check_positive(name: str, value: Any, most: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or \
            (most is not None and value > most):
        bound = "" if most is None else f" and <= {most}"
        raise ValueError(f"config key {name!r}: got {value!r}, expected an integer >= 1{bound}")


def check_epsilon(name: str, value: float) -> None:
    """A norm's epsilon: finite and positive (JSON's `Infinity` and `1e999` read as inf, which
    makes every normalised row 0 and every beam tie)."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"config key {name!r}: got {value!r}, expected a finite number > 0")


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
        try:
            value = float(value)
        except OverflowError:   # an integer of hundreds of digits
            raise ValueError(f"config key {key!r}: got an integer of {len(str(value))} digits, "
                             "beyond a float's range") from None
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
    if not path.exists() and not path.is_symlink():
        folder = path.parent   # the model directory: a file there is named as such
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"model directory {folder} is not a directory: give the directory "
                             "that holds config.json and the *.safetensors")
        raise ValueError(f"no config.json at {path}")
    try:   # a regular file of bounded size: a FIFO blocked, /dev/zero read until memory ran out
        raw = json.loads(read_regular_file(path, MAX_CONFIG_BYTES).decode())
    except FileRefused as e:
        raise ValueError(f"{path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw
