"""Model families by config class: `config.json`'s `model_type` -> the `RecModel` to build.

Adding a family is adding a model file and one line here; nothing else in the
engine asks which family runs.
"""

from __future__ import annotations

from xrec.config import FamilyConfig, ModelConfig
from xrec.model.family import RecModel
from xrec.config.qwen import QwenConfig


def model_class(config: FamilyConfig) -> type[RecModel]:
    from xrec.model.onerec import OneRecModel
    from xrec.model.qwen import QwenModel

    families: dict[type, type[RecModel]] = {ModelConfig: OneRecModel, QwenConfig: QwenModel}
    try:
        return families[type(config)]
    except KeyError:
        raise ValueError(f"no model family for a {type(config).__name__}") from None
