"""The contenders a benchmark runs side by side on one `Workload`.

* `XrecContender`: the Python API (`Engine.submit` for every request of the batch, then
  wait for all, as `Engine.recommend` does) in one normalisation, optionally with each
  request's item filter (`xrec-filter`);
* `HFContender`: Hugging Face `generate` on the same weights (exported as T5, or the
  decoder-only model directory loaded as it is), constrained with
  `prefix_allowed_tokens_fn` over the same catalog (a trie of Python lists);
* `NaiveContender` (naive.py): a generic beam search without xAttention.

Each `run` returns a `RunResult`: the batch's wall time, each request's latency and its
result triples, best first (for the overlap with the reference).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from xrec.bench.lib.models import Workload


@dataclass
class RunResult:
    wall_s: float
    latencies_s: list[float]
    triples: list[list[tuple[int, ...]]]          # per request, best first
    info: dict = field(default_factory=dict)


class XrecContender:
    """`engine` answers every request of the batch in `normalize` mode; `exclusions(workload)`
    gives each request's `exclude_items` (None: no filter)."""

    def __init__(self, engine, normalize: str, name: str,
                 exclusions: Callable[[Workload], list[np.ndarray]] | None = None):
        self.engine, self.normalize, self.name = engine, normalize, name
        self.pid = getattr(engine, "pid", None)    # a process-isolated engine's child
        self.exclusions = exclusions
        self._reports: list[int] = []           # requests per finished batch
        engine.add_report_hook(lambda report: self._reports.append(report.num_requests))
        self._requests: tuple[Workload | None, list] = (None, [])

    def run(self, workload: Workload) -> RunResult:
        from xrec import RecRequest

        cached, requests = self._requests
        if cached is not workload:   # built once per workload, outside the timed part
            excluded = self.exclusions(workload) if self.exclusions is not None else \
                [None] * workload.num_requests
            requests = [RecRequest(token_ids=row, beam_width=workload.beam_width,
                                   normalize=self.normalize, exclude_items=ids)
                        for row, ids in zip(workload.token_ids.tolist(), excluded)]
            self._requests = (workload, requests)
        done = [0.0] * len(requests)
        reports_before = len(self._reports)
        start = time.perf_counter()
        futures = self.engine.submit_many(requests)   # one wake-up: the batch is not split
        for index, future in enumerate(futures):
            future.add_done_callback(lambda _, i=index: done.__setitem__(i, time.perf_counter()))
        responses = [f.result() for f in futures]
        wall = time.perf_counter() - start
        triples = [[c.tokens for c in response.results] for response in responses]
        return RunResult(wall, [d - start for d in done], triples,
                         {"batches": self._batches_since(reports_before, len(requests))})

    def _batches_since(self, before: int, num_requests: int) -> int:
        """Batches the engine ran for this call (its report hook fires just after the answers)."""
        deadline = time.monotonic() + 1.0
        while sum(self._reports[before:]) < num_requests and time.monotonic() < deadline:
            time.sleep(0.0005)
        return len(self._reports) - before


def build_trie(triples: np.ndarray) -> dict[tuple[int, ...], list[int]]:
    """Catalog triples `[n, 3]` -> {prefix tuple: sorted allowed next tokens} (Python lists)."""
    unique = np.unique(np.asarray(triples, dtype=np.int64), axis=0)        # [U, 3] sorted
    trie: dict[tuple[int, ...], list[int]] = {}
    for depth in range(unique.shape[1]):
        pairs = np.unique(unique[:, :depth + 1], axis=0).tolist()          # sorted prefixes
        for row in pairs:
            trie.setdefault(tuple(row[:-1]), []).append(row[-1])
    return trie


def prefix_allowed_tokens(trie: dict[tuple[int, ...], list[int]], vocab_size: int,
                          start: int) -> Callable[[int, torch.Tensor], list[int]]:
    """`prefix_allowed_tokens_fn` for generate: the generated part of a sequence (from
    position `start`: after the decoder start token, or after the prompt) is looked up in
    the trie. A prefix outside the catalog (only a placeholder beam that HF keeps at -inf
    can have one) may continue with anything."""
    everything = list(range(vocab_size))

    def allowed(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        return trie.get(tuple(input_ids[start:].tolist()), everything)

    return allowed


class HFContender:
    """Constrained beam search with `generate` (num_beams = num_return_sequences = W), on an
    encoder-decoder (T5) or a decoder-only model."""

    name = "hf"

    def __init__(self, hf_model, trie: dict, rounds: int = 3):
        self.model, self.trie, self.rounds = hf_model, trie, rounds
        self.device = hf_model.device
        self.is_causal = not hf_model.config.is_encoder_decoder
        self._inputs: tuple[Workload | None, torch.Tensor | None] = (None, None)

    @torch.inference_mode()
    def run(self, workload: Workload) -> RunResult:
        cached, ids = self._inputs
        if cached is not workload:
            ids = torch.as_tensor(workload.token_ids, device=self.device)
            self._inputs = (workload, ids)
        width = workload.beam_width
        first = ids.shape[1] if self.is_causal else 1   # where the generated tokens start
        allowed = prefix_allowed_tokens(self.trie, self.model.config.vocab_size, first)
        start = time.perf_counter()
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=width,
            num_return_sequences=width, max_new_tokens=self.rounds, do_sample=False,
            length_penalty=0.0, eos_token_id=None, pad_token_id=0,
            prefix_allowed_tokens_fn=allowed)
        _sync(self.device)
        wall = time.perf_counter() - start
        rows = out[:, first:].view(workload.num_requests, width, self.rounds).tolist()  # [B, W, R]
        return RunResult(wall, [wall] * workload.num_requests,
                         [[tuple(t) for t in request] for request in rows])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def overlap(results: list[list[tuple[int, ...]]], reference: list[list[tuple[int, ...]]]) -> dict:
    """Per request |top-N ∩ reference top-N| / N (N: the reference's count); mean and min."""
    fractions = [len(set(a[:len(b)]) & set(b)) / len(b) for a, b in zip(results, reference) if b]
    if not fractions:
        return {"mean": None, "min": None}
    return {"mean": sum(fractions) / len(fractions), "min": min(fractions)}
