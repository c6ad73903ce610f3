"""Checkpoint I/O: `*.safetensors` (those `model.safetensors.index.json` names, where it exists)
in, `config.json` + safetensors (+ the index of shards) out. Never pickle.

`config.json`'s `model_type` picks the model family (`registry.py`); tensor names
are normalised to the names of that family's `state_dict` by its
`canonical_name` (OneRec: Hugging Face T5 names, with xllm's names and prefixes
mapped; Qwen: Hugging Face names as they are).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from xrec.config import FamilyConfig, read_model_config
from xrec.config.keys import read_json
from xrec.model.family import RecModel
from xrec.model.layers import stack_weights
from xrec.model.registry import model_class
from xrec.utils.files import (FileRefused, atomic_directory, check_regular_file, fsync_path,
                              new_file_mode)


INDEX_FILE = "model.safetensors.index.json"   # Hugging Face's map of sharded tensors to files


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: a file that is not valid safetensors, non-finite
    weights, or tensors that do not match the model config (names and shapes say why)."""


def read_checkpoint(model_dir: Path, config: FamilyConfig) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint in `model_dir`, under the family's names: those of the
    files `model.safetensors.index.json` names, each where the index says it is, or, without
    an index, of every `*.safetensors`."""
    family = model_class(config)
    weight_map = _read_index(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, tuple[str, str]] = {}
    for path in _checkpoint_files(model_dir, weight_map):
        with _open_safetensors(path) as f:
            for raw in f.keys():
                if weight_map is not None and weight_map.get(raw) != path.name:
                    where = "is not in it" if raw not in weight_map else \
                        f"maps it to {weight_map[raw]}"
                    raise CheckpointError(f"{path.name} holds tensor {raw!r}, but {INDEX_FILE} "
                                          f"{where}: the index does not describe these files")
                try:
                    name = family.canonical_name(raw, config)
                except ValueError as e:
                    raise CheckpointError(str(e)) from None
                if name in tensors:
                    first_raw, first_file = origin[name]
                    raise CheckpointError(
                        f"tensor {name!r} appears twice: as {first_raw!r} in {first_file} "
                        f"{list(tensors[name].shape)} and as {raw!r} in {path.name} "
                        f"{list(f.get_slice(raw).get_shape())}")
                tensors[name] = _read_tensor(f, raw, path)
                shown = repr(name) if raw == name else f"{name!r} ({raw!r})"
                _check_weight_dtype(tensors[name], shown, path)
                _check_finite(tensors[name], shown, f"in {path}")
                origin[name] = (raw, path.name)
    if weight_map is not None and len(origin) < len(weight_map):
        found = {raw for raw, _ in origin.values()}
        absent = sorted(raw for raw in weight_map if raw not in found)
        raise CheckpointError(f"{INDEX_FILE} maps {len(absent)} tensors to files that do not hold "
                              f"them: " + ", ".join(f"{raw!r} to {weight_map[raw]}"
                                                    for raw in absent[:8]))
    try:
        family.prepare_checkpoint(tensors, config)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return tensors


def _read_index(model_dir: Path) -> dict[str, str] | None:
    """The `weight_map` (tensor name -> file name) of `model_dir`'s index; None without one."""
    path = model_dir / INDEX_FILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        weight_map = read_json(path).get("weight_map")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not (isinstance(weight_map, dict) and weight_map and all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise CheckpointError(f"{path}: expected a 'weight_map' object of tensor names to file "
                              f"names, got {str(weight_map)[:80]}")
    for file in set(weight_map.values()):
        if file in ("", ".", "..") or "/" in file or "\\" in file:
            raise CheckpointError(f"{path}: weight_map names the file {file!r}; shards are files "
                                  f"of {model_dir}, named without a directory")
    return weight_map


def _checkpoint_files(model_dir: Path, weight_map: dict[str, str] | None) -> list[Path]:
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
        consolidated = model_dir / "model.safetensors"
        if consolidated.name not in names and (consolidated.exists() or consolidated.is_symlink()):
            # transformers reads model.safetensors then and ignores the index
            raise CheckpointError(f"{model_dir} holds both model.safetensors and {INDEX_FILE}, "
                                  "which names other files: transformers would load "
                                  "model.safetensors, the index says otherwise; remove the one "
                                  "that is stale")
        for name in names:
            if not (model_dir / name).exists():
                count = sum(file == name for file in weight_map.values())
                raise CheckpointError(f"{INDEX_FILE} maps {count} tensors to {name}, which is not "
                                      f"in {model_dir}")
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
                         for p in model_dir.glob(pattern))
        hint = f" (found {pickles}: pickle checkpoints are never loaded; convert to safetensors)" \
            if pickles else ""
        raise CheckpointError(f"no *.safetensors file in {model_dir}{hint}")
    return files


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
               dtype: torch.dtype | None = None) -> RecModel:
    """Read `config.json` and the safetensors of `model_dir` into an eval-mode model."""
    model_dir = Path(model_dir)
    config = read_model_config(model_dir / "config.json")
    tensors = read_checkpoint(model_dir, config)
    with torch.device("meta"):
        model = model_class(config)(config)
    check_tensors(tensors, {k: v.shape for k, v in model.state_dict().items()})
    dtype = dtype or getattr(torch, config.torch_dtype)
    cast = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    for name, tensor in cast.items():   # a value beyond a narrower dtype's range becomes inf
        if tensors[name].dtype != dtype:
            _check_finite(tensor, repr(name), f"after the cast to {dtype} (from {tensors[name].dtype})")
    stack_weights(cast, model.stacked)
    model.load_state_dict(cast, assign=True)
    return model.eval().requires_grad_(False)


def save_model(model_dir: str | Path, config: FamilyConfig, state_dict: dict[str, torch.Tensor],
               max_shard_bytes: int = 2 << 30) -> None:
    """Write `config.json` and `model.safetensors`, or, past `max_shard_bytes`, numbered shards
    and the `model.safetensors.index.json` that maps each tensor to its shard (as Hugging
    Face's `save_pretrained`). Whole or not at all: the files are written into a temporary
    directory beside `model_dir`, which then replaces it (`atomic_directory`), so a failed or
    killed save leaves the old checkpoint as it was. Other files of `model_dir` (a catalog, a
    tokenizer) are kept; its other `*.safetensors` and index are not (never mix checkpoints)."""
    model_dir = Path(model_dir).resolve()   # a symlink to the directory stays one
    if model_dir.exists() and not model_dir.is_dir():
        raise NotADirectoryError(f"model directory {model_dir} is not a directory")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous().clone()
        size += nbytes
        total += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with atomic_directory(model_dir, replace=True) as staging:
        if model_dir.is_dir():
            _keep_other_files(model_dir, staging)
        (staging / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        for file, shard in zip(files, shards):
            save_file(shard, str(staging / file), metadata={"format": "pt"})
            (staging / file).chmod(new_file_mode())   # safetensors writes 0600, whatever the umask
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            files.append(INDEX_FILE)
        for file in ["config.json", *files]:   # on disk before the swap: a power loss keeps old or new
            fsync_path(staging / file)
        fsync_path(staging)


def _keep_other_files(old: Path, new: Path) -> None:
    """Hard links (copies where the file system has none) in `new` of what `old` holds
    besides a checkpoint, and `old`'s mode on `new`."""
    new.chmod(stat.S_IMODE(old.stat().st_mode))
    for entry in old.iterdir():
        if entry.name == "config.json" or entry.name.endswith((".safetensors", INDEX_FILE)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / entry.name)


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)




@contextmanager
def _open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open(path)`; an unreadable file is the OS's error with the path (safetensors says
    "No such file or directory" for a permission problem too), a file that is not safetensors
    (truncated, corrupt) one `CheckpointError` line naming it."""
    try:   # a regular file, opened without blocking (a FIFO named *.safetensors hung)
        check_regular_file(path)
    except FileRefused as e:
        raise CheckpointError(f"{path}: {e}") from None
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({os.path.getsize(path)} "
                              f"bytes; {e}): it is truncated or corrupt") from None
    with handle as f:
        yield f


def _read_tensor(f: Any, raw: str, path: Path) -> torch.Tensor:
    try:
        return f.get_tensor(raw)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: tensor {raw!r} cannot be read ({e}): the file is "
                              "corrupt") from None


WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_weight_dtype(tensor: torch.Tensor, name: str, path: Path) -> None:
    """Weights are floating point: an integer, boolean or complex tensor cast to the model's
    dtype loaded as a silently wrong model, and float8 failed deep inside torch."""
    if tensor.dtype not in WEIGHT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
        raise CheckpointError(f"tensor {name} in {path} has dtype "
                              f"{str(tensor.dtype).removeprefix('torch.')}; weights are read "
                              f"from {allowed}")


def _check_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    """NaN or inf weights answer every request with nothing: refused at load."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        num_bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"tensor {name} {where} holds {num_bad} non-finite values (NaN "
                              f"or inf) of {tensor.numel()}; weights must be finite")


def _listing(names: list[str], shapes: dict[str, torch.Size], limit: int = 8) -> str:
    shown = ", ".join(f"{n!r} {list(shapes[n])}" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
