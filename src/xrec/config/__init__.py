"""Configuration, torch-free: the two model families' `config.json`, named sizes, engine options.

    onerec.py   ModelConfig: OneRec encoder-decoder (xllm "onerec" and Hugging Face "t5" keys)
    qwen.py     QwenConfig: Qwen2 / Qwen3 / Qwen3-MoE decoder-only (Hugging Face keys)
    family.py   FamilyConfig (what the search reads of either), config.json -> the right class
    keys.py     config.json value checks shared by both families
    sizes.py    named sizes for `xrec make-model` and the benchmarks
    engine.py   EngineOptions and their CLI flags
"""

from xrec.config.engine import EngineOptions
from xrec.config.family import FamilyConfig, model_config_from_dict, read_model_config
from xrec.config.onerec import ModelConfig
from xrec.config.qwen import QwenConfig
from xrec.config.sizes import MODEL_SIZES

__all__ = ["EngineOptions", "FamilyConfig", "MODEL_SIZES", "ModelConfig", "QwenConfig",
           "model_config_from_dict", "read_model_config"]
