"""Checkpoint I/O: `*.safetensors` in, `config.json` + safetensors out. Never pickle.

Tensor names are normalised to the canonical (Hugging Face T5) names that
`OneRecModel.state_dict()` uses: optional prefixes `module.module3.t5_model.`
and `model.` are stripped, and xllm's FFN / MoE names are mapped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from xrec.config import ModelConfig
from xrec.model.onerec import OneRecModel

PREFIXES = ("module.module3.t5_model.", "model.")
# Copies of `shared.weight` that some T5 checkpoints carry; equal by construction.
EMBEDDING_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_RENAMES = [
    # xllm dense FFN: gate_proj = gate, wi = up, wo = down
    (re.compile(r"\.(?:DenseReluDense|ffn)\.gate_proj\.weight$"), ".DenseReluDense.wi_0.weight"),
    (re.compile(r"\.(?:DenseReluDense|ffn)\.wi\.weight$"), ".DenseReluDense.wi_1.weight"),
    (re.compile(r"\.ffn\.wo\.weight$"), ".DenseReluDense.wo.weight"),
    # xllm MoE: router, experts' gate_proj/up_proj/down_proj
    (re.compile(r"\.ffn\.router\.weight$"), ".ffn.gate.weight"),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.gate_proj\.weight$"), r".\1.w1.weight"),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.up_proj\.weight$"), r".\1.w3.weight"),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.down_proj\.weight$"), r".\1.w2.weight"),
]


class CheckpointError(ValueError):
    """A checkpoint that does not match the model config: names and shapes say why."""


def canonical_name(name: str, is_moe: bool) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    if is_moe and re.match(r"decoder\.block\.\d+\.layer\.2\.DenseReluDense\.", name):
        raise CheckpointError(f"tensor {name!r} is a dense FFN, but config.json says use_moe=true")
    return name


def read_checkpoint(model_dir: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors of all `*.safetensors` files in `model_dir`, under canonical names."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
                         for p in model_dir.glob(pattern))
        hint = f" (found {pickles}: pickle checkpoints are never loaded; convert to safetensors)" \
            if pickles else ""
        raise CheckpointError(f"no *.safetensors file in {model_dir}{hint}")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, tuple[str, str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for raw in f.keys():
                name = canonical_name(raw, config.use_moe)
                if name in tensors:
                    first_raw, first_file = origin[name]
                    raise CheckpointError(
                        f"tensor {name!r} appears twice: as {first_raw!r} in {first_file} "
                        f"{list(tensors[name].shape)} and as {raw!r} in {path.name} "
                        f"{list(f.get_slice(raw).get_shape())}")
                tensors[name] = f.get_tensor(raw)
                origin[name] = (raw, path.name)
    aliases = [n for n in EMBEDDING_ALIASES if n in tensors]
    if "shared.weight" not in tensors and aliases:
        tensors["shared.weight"] = tensors[aliases[0]]
    for name in aliases:
        del tensors[name]
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters write the tied head out; it is `shared`
    if config.use_absolute_position_embedding:
        # a T5 checkpoint switched to absolute mode may still carry zeroed bias tables
        for name in [n for n in tensors if n.endswith("relative_attention_bias.weight")]:
            if tensors[name].count_nonzero():
                raise CheckpointError(f"tensor {name!r} holds a non-zero relative position bias, "
                                      "but config.json says use_absolute_position_embedding=true")
            del tensors[name]
    return tensors


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors (with the shapes config.json implies): "
                        f"{_listing(missing, expected)}")
    if unexpected:
        problems.append(f"unexpected tensors (with their shapes): "
                        f"{_listing(unexpected, {n: tensors[n].shape for n in unexpected})}")
    for name in sorted(set(expected) & set(tensors)):
        if tuple(tensors[name].shape) != tuple(expected[name]):
            problems.append(f"tensor {name!r} has shape {list(tensors[name].shape)}, "
                            f"config.json implies {list(expected[name])}")
    if problems:
        raise CheckpointError("checkpoint does not match config.json: " + "; ".join(problems))


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> OneRecModel:
    """Read `config.json` and the safetensors of `model_dir` into an eval-mode model."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_file(model_dir / "config.json")
    tensors = read_checkpoint(model_dir, config)
    with torch.device("meta"):
        model = OneRecModel(config)
    check_tensors(tensors, {k: v.shape for k, v in model.state_dict().items()})
    dtype = dtype or getattr(torch, config.torch_dtype)
    tensors = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    model.load_state_dict(tensors, assign=True)
    return model.eval().requires_grad_(False)


def save_model(model_dir: str | Path, config: ModelConfig, state_dict: dict[str, torch.Tensor],
               max_shard_bytes: int = 2 << 30) -> None:
    """Write `config.json` and `model.safetensors` (or numbered shards past `max_shard_bytes`)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    for stale in model_dir.glob("*.safetensors"):  # a reused directory must not mix checkpoints
        stale.unlink()
    (model_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous().clone()
        size += nbytes
    for index, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else \
            f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / name), metadata={"format": "pt"})


def _listing(names: list[str], shapes: dict[str, torch.Size], limit: int = 8) -> str:
    shown = ", ".join(f"{n!r} {list(shapes[n])}" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
