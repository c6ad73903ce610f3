"""Model families by config class: `config.json`'s `model_type` -> the `RecModel` to build.

Adding a family is adding a model file and one line here; nothing else in the
engine asks which family runs.
"""

from __future__ import annotations

from typing import Any

from xrec.config import ModelConfig
from xrec.model.family import RecModel
from xrec.qwen_config import QwenConfig


def model_class(config: Any) -> type[RecModel]:
    from xrec.model.onerec import OneRecModel
    from xrec.model.qwen import QwenModel

    families: dict[type, type[RecModel]] = {ModelConfig: OneRecModel, QwenConfig: QwenModel}
    try:
        return families[type(config)]
    except KeyError:
        raise ValueError(f"no model family for a {type(config).__name__}") from None
