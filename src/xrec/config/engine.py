"""Engine options (docs/serving.md): one frozen dataclass, the `Engine.from_pretrained` keyword
arguments and the CLI flags of the same names (`add_cli_args`, `from_args`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any

from xrec.config.keys import DTYPES
from xrec.errors import InvalidArgument

MAX_GRACE_S = 86_400.0   # close(grace_s): a day of draining at most (`checked_grace_s`)

@dataclass(frozen=True)
class EngineOptions:
    """Engine options (docs/serving.md); CLI flags and `Engine.from_pretrained` kwargs of the
    same names. `None` means "derived": see `resolve`."""

    device: str = "auto"                 # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"                  # "auto" (bfloat16 where native and the family allows
                                         # it, else float32: xrec.model.dtype) | DTYPES
    max_concurrency: int | None = None   # pipelines; default 1 on CPU, 2 on CUDA
    max_seqs_per_batch: int = 64
    max_tokens_per_batch: int = 65536    # encoder + decoder-prefix tokens
    max_beams_per_batch: int = 8192
    max_beam_width: int = 512
    max_top_k: int = 1024                # also bounds num_return_sequences (the last round's K)
    max_input_len: int = 4096
    request_queue_size: int = 1024
    max_memory_utilization: float = 0.9
    default_beam_width: int = 128
    rounds: int = 3
    normalize: str = "allowed"
    constrained: bool | None = None      # default: on when a catalog is loaded
    batch_wait_ms: float = 0.0
    request_timeout_ms: float | None = None
    each_conversion_threshold: int = 50
    max_exclude_items: int = 100_000     # ids in one request's exclude_items
    total_conversion_threshold: int = 1000
    generation_prefix: str | tuple[int, ...] | None = None   # decoder-only: appended to every
                                         # prompt (text, tokenized; or ids), e.g. "<|sid_begin|>"
    num_threads: int | None = None       # CPU intra-op threads in all; default: all cores
    adaptive_threads: bool | None = None  # CPU: fewer threads while other processes take cores
                                         # (engine/threads.py); None: on unless
                                         # XREC_ADAPTIVE_THREADS=0
    retain_host_memory: bool | None = None   # CPU: freed memory stays mapped for the next batch
                                         # (glibc thresholds, process-wide; engine/host.py). None:
                                         # in processes that exist to serve (xrec serve, xrec
                                         # batch, isolation="process", Ray); True: also in a host's
                                         # process (an engine embedded in an application)
    cuda_graphs: bool | None = None      # capture each pipeline's decode rounds per bucket and
                                         # replay them (search/graphs.py); None: on for CUDA;
                                         # true needs a CUDA device
    fused_kernels: bool | None = None    # compile the model's element-wise chains (RMSNorm, gated
                                         # SiLU, xAttention's merge) into one kernel each, at load
                                         # (model/fusion.py). None: on for a CPU model in bfloat16
                                         # or float16 unless XREC_FUSED_KERNELS=0, off where
                                         # compiling fails; true needs a CPU model

    def __post_init__(self) -> None:
        ranges = {"max_seqs_per_batch": (1, 1 << 16), "max_tokens_per_batch": (1, 1 << 30),
                  "max_beams_per_batch": (1, 1 << 24), "max_beam_width": (1, 1 << 14),
                  "max_top_k": (1, 1 << 16), "max_input_len": (1, 1 << 24),
                  "request_queue_size": (1, 1 << 24), "default_beam_width": (1, 1 << 14),
                  "rounds": (1, 64), "each_conversion_threshold": (0, 1 << 30),
                  "max_exclude_items": (0, 1 << 24),
                  "total_conversion_threshold": (0, 1 << 30)}
        for name, (low, high) in ranges.items():
            _check_range(name, getattr(self, name), low, high)
        if self.max_concurrency is not None:
            _check_range("max_concurrency", self.max_concurrency, 1, 64)
        if self.num_threads is not None:
            _check_range("num_threads", self.num_threads, 1, 4096)
        if self.max_top_k < self.max_beam_width:
            raise ValueError(f"option max_top_k: got {self.max_top_k}, must be >= max_beam_width="
                             f"{self.max_beam_width} (top_k >= beam_width)")
        if self.default_beam_width > self.max_beam_width:
            raise ValueError(f"option default_beam_width: got {self.default_beam_width}, must be <= "
                             f"max_beam_width={self.max_beam_width}")
        if self.max_beam_width > self.max_beams_per_batch:
            raise ValueError(f"option max_beam_width: got {self.max_beam_width}, must be <= "
                             f"max_beams_per_batch={self.max_beams_per_batch}")
        if not (_is_number(self.max_memory_utilization) and 0 < self.max_memory_utilization <= 1):
            raise ValueError(f"option max_memory_utilization: got {self.max_memory_utilization!r}, "
                             "allowed: 0 < value <= 1")
        for name, default in _SWITCHES.items():   # "false" is a truthy str: never taken as one
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"option {name}: got {value!r}, allowed: true, false, or None "
                                 f"({default})")
        if self.normalize not in ("allowed", "full"):
            raise ValueError(f"option normalize: got {self.normalize!r}, allowed: 'allowed', 'full'")
        if self.dtype not in ("auto",) + DTYPES:
            raise ValueError(f"option dtype: got {self.dtype!r}, allowed: 'auto', {', '.join(DTYPES)}")
        if not (isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda")
                                                  or _is_cuda_index(self.device))):
            raise ValueError(f"option device: got {self.device!r}, allowed: 'auto', 'cpu', 'cuda', 'cuda:N'")
        if not (_is_number(self.batch_wait_ms) and 0 <= self.batch_wait_ms <= 60_000):
            raise ValueError(f"option batch_wait_ms: got {self.batch_wait_ms!r}, allowed: [0, 60000]")
        prefix = self.generation_prefix
        if prefix is not None and not isinstance(prefix, str):
            if isinstance(prefix, list):
                object.__setattr__(self, "generation_prefix", tuple(prefix))
                prefix = self.generation_prefix
            if not (isinstance(prefix, tuple) and all(isinstance(i, int) and not isinstance(i, bool)
                                                      for i in prefix)):
                raise ValueError(f"option generation_prefix: got {prefix!r}, allowed: text, a list of "
                                 "token ids, or None")
        if self.request_timeout_ms is not None and not (
                _is_number(self.request_timeout_ms) and self.request_timeout_ms > 0):
            raise ValueError(f"option request_timeout_ms: got {self.request_timeout_ms!r}, "
                             "expected a positive number or None")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, the same name with dashes (`--max-concurrency`), default unset."""
        group = parser.add_argument_group("engine options")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.name == "generation_prefix":
                group.add_argument(flag, type=parse_generation_prefix, default=None,
                                   metavar="TEXT|[IDS]",
                                   help="decoder-only models: appended to every prompt, as text "
                                   "(e.g. '<|sid_begin|>') or a JSON list of token ids")
            elif f.type in ("bool | None", "bool"):
                group.add_argument(flag, type=parse_bool, default=None, metavar="true|false")
            elif "int" in str(f.type):
                group.add_argument(flag, type=int, default=None)
            elif "float" in str(f.type):
                group.add_argument(flag, type=float, default=None)
            else:
                group.add_argument(flag, default=None)

    @classmethod
    def kwargs_from_cli(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The options given on the command line (`add_cli_args`), as keyword arguments;
        unset flags are left out, so they keep their defaults."""
        return {f.name: getattr(args, f.name) for f in fields(cls)
                if getattr(args, f.name, None) is not None}

    @classmethod
    def from_kwargs(cls, **options: Any) -> "EngineOptions":
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; allowed: "
                             f"{sorted(f.name for f in fields(cls))}")
        return cls(**options)


# the options that are true, false or None, and what None means
_SWITCHES = {"constrained": "on when a catalog is loaded",
             "adaptive_threads": "on unless XREC_ADAPTIVE_THREADS=0",
             "retain_host_memory": "where the engine owns its process",
             "cuda_graphs": "on for CUDA",
             "fused_kernels": "on for a CPU model in bfloat16 or float16"}


def _is_number(value: Any) -> bool:
    """An int or float that converts to a float (10**400 does not); not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _is_cuda_index(device: str) -> bool:
    """Whether `device` is "cuda:N" as torch reads it: N in ASCII digits, no leading zero
    ("cuda:x", "cuda:-1", "cuda:01" and "cuda:" passed here and failed only at load, with
    torch's RuntimeError)."""
    index = device.removeprefix("cuda:")
    return (device.startswith("cuda:") and index.isascii() and index.isdigit()
            and (index == "0" or not index.startswith("0")))


def checked_grace_s(grace_s: Any) -> float:
    """`close(grace_s)`'s seconds, checked before an engine starts closing: a number >= 0.
    Infinity ("as long as it takes") is MAX_GRACE_S: threads cannot wait longer than
    threading.TIMEOUT_MAX, and an inf that overflowed a wait left the engine's threads
    running and its queued requests unanswered."""
    if not _is_number(grace_s) or not grace_s >= 0:   # NaN too
        raise InvalidArgument(f"grace_s: got {grace_s!r}, expected seconds >= 0 (infinity: "
                              f"{MAX_GRACE_S:g})")
    return min(float(grace_s), MAX_GRACE_S)


def check_grace_flag(grace_s: Any) -> None:
    """`--grace-s` of `xrec serve` (with or without --ray): seconds in [0, MAX_GRACE_S],
    checked before anything starts. NaN and inf are refused here, where `checked_grace_s`
    reads inf as a day: a flag's inf is more likely a slip than a wish."""
    if not (_is_number(grace_s) and 0 <= grace_s <= MAX_GRACE_S):
        raise ValueError(f"--grace-s: got {grace_s}, expected seconds in [0, {MAX_GRACE_S:g}]")


def _check_range(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"option {name}: got {value!r}, allowed: an integer in [{low}, {high}]")


def parse_generation_prefix(text: str) -> str | tuple[int, ...]:
    """A `--generation-prefix` value: text, or a JSON list of token ids ("[151669]")."""
    if not text.startswith("["):
        return text
    try:
        ids = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected text or a JSON list of token ids, got {text!r}") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise argparse.ArgumentTypeError(f"expected a JSON list of token ids, got {text!r}")
    return tuple(ids)


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")

def add_catalog_flags(parser: argparse.ArgumentParser) -> None:
    """`--catalog FILE` and how to read it (docs/catalog.md, "Which catalog a model serves")."""
    parser.add_argument("--catalog", help="catalog file (default: the model directory's)")
    parser.add_argument("--catalog-extended", type=parse_bool, default=None, metavar="true|false",
                        help="read --catalog's extended records (a did and a type per item) "
                        "(default: as the model directory's tokenizer_config.json says, "
                        "\"extended_item_info\"; false for a .txt/.csv file)")


def check_catalog_flags(catalog: str | None, catalog_extended: bool | None) -> None:
    """`--catalog-extended` only with `--catalog` (`xrec serve`, `recommend`, `batch`, and
    `xrec serve --ray`'s options)."""
    if catalog_extended is not None and catalog is None:
        raise ValueError("--catalog-extended: says how to read --catalog FILE, which is not "
                         "given (the model directory's catalog is read as its "
                         "tokenizer_config.json's extended_item_info says)")
