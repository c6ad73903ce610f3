"""The naive contender: a generic beam search on xrec's model pieces, without xAttention.

What a textbook encoder-decoder beam search does (and what HF `generate` does without
its KV cache): the encoder output is copied for every beam and the cross K/V computed
per copy; every round re-runs the decoder over each beam's whole sequence (BOS + the
tokens so far, one-stage causal attention); the constraint is a per-beam trie lookup in
Python; normalisation over the full vocabulary ("full", as HF); the next beams are the
top W of all W x V candidates of a request. Beams 1..W-1 start at -inf, as in HF.
"""

from __future__ import annotations

import time

import torch

from xrec.bench.lib.contenders import RunResult, _sync
from xrec.bench.lib.models import Workload


class NaiveContender:
    name = "naive"

    def __init__(self, model, trie: dict[tuple[int, ...], list[int]], rounds: int = 3):
        self.model, self.trie, self.rounds = model, trie, rounds
        self.device = model.shared.weight.device
        self._allowed: dict[tuple[int, ...], torch.Tensor] = {}
        self._everything = torch.arange(model.config.vocab_size, device=self.device)

    def _allowed_mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        """`[N, V]` bool: the tokens the catalog allows after each beam's prefix."""
        mask = torch.zeros((len(prefixes), self.model.config.vocab_size), dtype=torch.bool,
                           device=self.device)
        for row, prefix in enumerate(prefixes):
            key = tuple(prefix)
            tokens = self._allowed.get(key)
            if tokens is None:
                allowed = self.trie.get(key)
                tokens = self._everything if allowed is None else \
                    torch.tensor(allowed, device=self.device)
                self._allowed[key] = tokens
            mask[row, tokens] = True
        return mask

    @torch.inference_mode()
    def run(self, workload: Workload) -> RunResult:
        model, device = self.model, self.device
        num_batch, width = workload.num_requests, workload.beam_width
        vocab = model.config.vocab_size
        start = time.perf_counter()
        ids = torch.as_tensor(workload.token_ids, device=device)
        encoded = model.encode(model.embed(ids), None)                       # [B, L, D]
        cross = model.prepare_cross(encoded.repeat_interleave(width, dim=0), None)  # per beam
        seqs = torch.full((num_batch * width, 1), model.config.bos_token_id, device=device)
        scores = torch.full((num_batch, width), float("-inf"), device=device)
        scores[:, 0] = 0.0
        offsets = torch.arange(num_batch, device=device).unsqueeze(1) * width
        for _ in range(self.rounds):
            lengths = torch.full((len(seqs),), seqs.shape[1], device=device)
            last, _ = model.decode_prefix(model.embed(seqs), lengths, False, cross)  # [B*W, D]
            lp = torch.log_softmax(model.logits(last), dim=-1)                  # [B*W, V]
            lp = lp.masked_fill(~self._allowed_mask(seqs[:, 1:].tolist()), float("-inf"))
            candidates = (scores.view(-1, 1) + lp).view(num_batch, width * vocab)
            scores, flat = candidates.topk(width, dim=-1)                      # [B, W]
            parents = (flat // vocab + offsets).flatten()
            seqs = torch.cat([seqs[parents], (flat % vocab).view(-1, 1)], dim=1)
        _sync(device)
        wall = time.perf_counter() - start
        rows = seqs[:, 1:].view(num_batch, width, self.rounds).tolist()
        return RunResult(wall, [wall] * num_batch, [[tuple(t) for t in r] for r in rows])
