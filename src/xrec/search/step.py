"""RecStep: one batch of requests, all R rounds, on one device (and stream).

    round 0:  model.prefill (encoder + decoder prefix, or the prompt) -> top-W first tokens
    round r:  model.decode_step for B x W beams (xAttention) -> constrained top-K
              -> global top-W (top-N in the last round) -> reorder beam K/V

The search never asks which model family runs (model/family.py). The rounds run
back to back without a host synchronisation; the results are copied to the host
once at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from xrec.catalog import ConstraintTables
from xrec.model.family import RecModel
from xrec.model.kv import BeamKV
from xrec.search.batch import StepBatch
from xrec.search.filters import SearchFilter
from xrec.search.workspace_buffers import Workspace
from xrec.search.beam import (follow_parents, gather_children, mask_beyond, normalize,
                              select_top)


@dataclass(frozen=True)
class StepOutput:
    """Per request the best `num_results[b]` candidates, best first (host arrays).
    Candidates with score -inf are not real results (too few catalog items)."""

    tokens: np.ndarray          # [B, N, R] int64
    scores: np.ndarray          # [B, N] float32
    token_logprobs: np.ndarray  # [B, N, R] float32
    num_results: list[int]


@dataclass(frozen=True, eq=False)
class DecodeState:
    """What the decode rounds of a batch read (round 0 leaves it): the model's context
    (cross / prefix / prompt K/V), each beam's trie node, score, tokens and log-probs so
    far, and the batch's settings. Its tensors and host values are all a captured graph
    depends on (search/graphs.py keys graphs by them)."""

    context: Any
    nodes: torch.Tensor           # [B, W] int64
    scores: torch.Tensor          # [B, W] float32
    tokens: torch.Tensor          # [B, W, r] int64
    logprobs: torch.Tensor        # [B, W, r] float32
    widths: torch.Tensor | None   # per-request beam widths (None: all equal)
    results: torch.Tensor | None  # per-request result counts (None: all equal)
    rows: "_Rows"
    filters: SearchFilter | None
    allocate: Callable | None     # the pipeline's workspace (`Workspace.take`)
    num_beams: int
    num_out: int

    @property
    def num_batch(self) -> int:
        return self.nodes.shape[0]


class DecodeRunner(Protocol):
    """Runs a batch's decode rounds another way (search/graphs.py `DecodeGraphs`: captured)."""

    def run(self, step: RecStep, state: DecodeState, workspace: Workspace | None,
            before_round: Callable[[int], None] | None) -> DeviceOutput: ...


@dataclass(frozen=True)
class DeviceOutput:
    """`StepOutput`'s tensors, still on the step's device (before the one copy back)."""

    tokens: torch.Tensor          # [B, N, R] int64
    scores: torch.Tensor          # [B, N] float32
    token_logprobs: torch.Tensor  # [B, N, R] float32


class RecStep:
    """Runs a `StepBatch` through the model and the constrained beam search.

    Holds no per-batch state, so several pipelines may share one instance.
    `tables` None means unconstrained decoding over the whole vocabulary.
    """

    def __init__(self, model: RecModel, tables: ConstraintTables | None, rounds: int = 3):
        if tables is not None and tables.max_children[0] == 0:
            raise ValueError("the catalog has no items: constrained decoding has nothing to choose from")
        if tables is not None and rounds != tables.num_levels:
            # fewer rounds would return prefixes, which are not catalog items
            raise ValueError(f"rounds={rounds}, but the catalog's semantic IDs have {tables.num_levels} "
                             f"tokens; constrained decoding needs rounds={tables.num_levels}")
        self.model, self.tables, self.rounds = model, tables, rounds
        self.device = model.device
        vocab = model.config.vocab_size
        # Below a quarter of the vocabulary, LM-head rows of the children beat the full head
        # (round 0: the root's children, one set for every request).
        self.is_narrow = [4 * c < vocab for c in tables.max_children] if tables is not None else []
        self.root_children = _root_children(tables) if tables is not None else None

    def run(self, batch: StepBatch, workspace: Workspace | None = None,
            before_round: Callable[[int], None] | None = None,
            graphs: DecodeRunner | None = None) -> StepOutput:
        """All rounds of `batch`, results on the host. `workspace`: the calling pipeline's
        reusable buffers (None: fresh buffers for this batch only). `before_round(r)` is
        called on the host before round r (round 0 includes the prefill); what it raises
        stops the batch there, between rounds. It reads no device value, so on CUDA it adds
        no synchronisation: it stops the rounds not yet queued. `graphs`: see
        `run_on_device`."""
        output = self.run_on_device(batch, workspace, before_round, graphs)
        return _to_host(output, batch.num_results)

    @torch.inference_mode()
    def run_on_device(self, batch: StepBatch, workspace: Workspace | None = None,
                      before_round: Callable[[int], None] | None = None,
                      graphs: DecodeRunner | None = None) -> DeviceOutput:
        """`run` without the copy back: the capturable part of a step (docs/beam-search.md,
        Capturable step). No tensor value is read on the host: what the rounds decide
        stays on the device, and every shape and branch follows from the batch's host-side
        settings and the catalog's host-side facts (`ConstraintTables.max_children`).
        `graphs`: the calling pipeline's captured decode rounds (search/graphs.py); round 0
        (the prompt or encoder) always runs eagerly."""
        state = self.first_round(batch, workspace, before_round)
        if self.rounds == 1:
            return DeviceOutput(state.tokens, state.scores, state.logprobs)
        if graphs is not None:
            return graphs.run(self, state, workspace, before_round)
        return self.decode_rounds(state, before_round)

    def first_round(self, batch: StepBatch, workspace: Workspace | None = None,
                    before_round: Callable[[int], None] | None = None) -> DecodeState:
        """Round 0: the prompt or encoder pass and the first tokens; what the decode rounds
        read next."""
        model, device = self.model, self.device
        num_batch = batch.num_requests
        temps = None if all(t in (0.0, 1.0) for t in batch.temperatures) else \
            torch.tensor([t or 1.0 for t in batch.temperatures], device=device).view(-1, 1, 1)
        state = DecodeState(
            context=None, nodes=torch.zeros((num_batch, 1), dtype=torch.long, device=device),
            scores=torch.zeros((num_batch, 1), device=device),
            tokens=torch.zeros((num_batch, 1, 0), dtype=torch.long, device=device),
            logprobs=torch.zeros((num_batch, 1, 0), device=device),
            widths=_widths(batch.beam_widths, device), results=_widths(batch.num_results, device),
            rows=_Rows(batch.full_rows, num_batch, device, temps),
            filters=None if batch.filters is None else batch.filters.to(device),
            allocate=None if workspace is None else workspace.take,
            num_beams=max(batch.beam_widths), num_out=max(batch.num_results))
        if before_round is not None:
            before_round(0)
        last, context = model.prefill(batch.inputs, state.allocate)        # [B, D], shared state
        return self._select(replace(state, context=context), last.unsqueeze(1), 0, None)

    def decode_rounds(self, state: DecodeState,
                      before_round: Callable[[int], None] | None = None) -> DeviceOutput:
        """Rounds 1 .. R-1 from the state round 0 left: every kernel a graph captures. The
        beam K/V comes from the state's `allocate` (the pipeline's workspace)."""
        beams = None
        for round_index in range(1, self.rounds):
            if before_round is not None:
                before_round(round_index)
            if beams is None:
                beams = self.model.new_beam_kv(state.num_batch, state.num_beams, self.rounds,
                                               state.allocate)
            step_hidden = self.model.decode_step(state.tokens[:, :, -1], round_index,
                                                 state.context, beams)     # [B, W, D]
            state = self._select(state, step_hidden, round_index, beams)
        return DeviceOutput(state.tokens, state.scores, state.logprobs)

    def _select(self, state: DecodeState, step_hidden: torch.Tensor, round_index: int,
                beams: BeamKV | None) -> DecodeState:
        """One round's constrained top-k over `step_hidden [B, W, D]`, the beams' update and
        (between decode rounds) the beam K/V reorder."""
        is_last = round_index == self.rounds - 1
        keep = state.num_out if is_last else state.num_beams
        lp, cand_tokens, first = self._candidates(step_hidden, state.nodes, round_index, keep,
                                                  state.rows, state.filters)
        num_cand = lp.shape[-1]
        cand_scores = (state.scores.unsqueeze(-1) + lp).flatten(1)       # [B, W*C]
        scores, flat = select_top(cand_scores, keep)                       # [B, keep]
        scores = mask_beyond(scores, state.results if is_last else state.widths)
        parents, child = flat // num_cand, flat % num_cand
        chosen = cand_tokens.flatten(1).gather(1, flat)                    # [B, keep]
        chosen_lp = lp.flatten(1).gather(1, flat)
        tokens = torch.cat([follow_parents(state.tokens, parents), chosen.unsqueeze(-1)], dim=-1)
        logprobs = torch.cat([follow_parents(state.logprobs, parents), chosen_lp.unsqueeze(-1)],
                             dim=-1)
        nodes = state.nodes
        if first is not None:
            level_size = len(self.tables.tokens[round_index])
            nodes = (first.gather(1, parents) + child).clamp(max=level_size - 1)
        if beams is not None and not is_last:
            offsets = torch.arange(state.num_batch, device=self.device).unsqueeze(1) * state.num_beams
            beams.reorder((parents + offsets).flatten(), num_written=round_index)
        return replace(state, nodes=nodes, scores=scores, tokens=tokens, logprobs=logprobs)

    def _candidates(self, hidden: torch.Tensor, nodes: torch.Tensor, level: int, keep: int,
                    rows: "_Rows", filters: SearchFilter | None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-probs `[B, W, C]` of each beam's candidate tokens `[B, W, C]`, and the
        index of each beam's first child in the level (None when unconstrained). A child
        a request's filter removed is not a candidate of that request's beams."""
        model = self.model
        if self.tables is None:
            lp = torch.log_softmax(rows.scale(model.logits(hidden)), dim=-1)   # [B, W, V]
            # per beam, best first; equal log-probs in token order (the tie rule)
            values, token_ids = select_top(lp.flatten(0, 1), min(keep, lp.shape[-1]))
            return values.view(*lp.shape[:2], -1), token_ids.view(*lp.shape[:2], -1), None
        tables = self.tables
        children = gather_children(tables.offsets[level], tables.tokens[level], nodes,
                                   tables.max_children[level])
        keep_filtered = None if filters is None else filters.allowed(level, children.nodes)
        if keep_filtered is not None:
            children = replace(children, is_valid=children.is_valid & keep_filtered)
        num_batch, num_beams, num_cand = children.tokens.shape
        full_logits = None
        if self.is_narrow[level] and level == 0:   # every beam at the root: one set of rows
            logits = model.shared_candidate_logits(hidden.flatten(0, 1), self.root_children)
            logits = logits.view(num_batch, num_beams, num_cand)
        elif self.is_narrow[level]:   # LM-head rows of each beam's children only
            logits = model.candidate_logits(hidden.flatten(0, 1), children.tokens.flatten(0, 1))
            logits = logits.view(num_batch, num_beams, num_cand)
        else:
            full_logits = model.logits(hidden)                              # [B, W, V]
            logits = full_logits.gather(-1, children.tokens)
        logits = rows.scale(logits)                                         # [B, W, C]
        if not rows.full_rows:
            return normalize(logits, children.is_valid, None), children.tokens, children.first
        # "full" rows normalise over the whole vocabulary
        index = None if rows.is_all_full else rows.full_index  # pragma: no mutate
        if full_logits is not None:
            lse = torch.logsumexp(rows.scale(full_logits if index is None else full_logits[index],
                                             index), dim=-1)
        else:
            selected = hidden if index is None else hidden[index]           # [Bf, W, D]
            lse = model.logits_logsumexp(selected.flatten(0, 1), rows.row_scale(index, num_beams))
            lse = lse.view(selected.shape[:2])
        if index is None:
            return normalize(logits, children.is_valid, lse), children.tokens, children.first
        lp = normalize(logits, children.is_valid, None)
        lp[index] = normalize(logits[index], children.is_valid[index], lse)
        return lp, children.tokens, children.first


class _Rows:
    """Which requests of a batch normalise over the full vocabulary, and their temperatures."""

    def __init__(self, full_rows: list[int], num_batch: int, device: torch.device,
                 temperatures: torch.Tensor | None):
        self.full_rows = full_rows
        self.is_all_full = len(full_rows) == num_batch  # pragma: no mutate
        self.full_index = torch.tensor(full_rows, dtype=torch.long, device=device)
        self.temperatures = temperatures                                   # [B, 1, 1] or None

    def row_scale(self, index: torch.Tensor | None, num_beams: int) -> torch.Tensor | None:
        """1 / temperature per beam row `[len(index) * W]` of the selected requests, or None."""
        if self.temperatures is None:
            return None
        temps = self.temperatures if index is None else self.temperatures[index]
        return (1.0 / temps.view(-1, 1)).expand(-1, num_beams).reshape(-1)

    def scale(self, logits: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        if self.temperatures is None:
            return logits
        temps = self.temperatures if index is None else self.temperatures[index]
        return logits / temps


def _root_children(tables: ConstraintTables) -> torch.Tensor | slice:
    """The root's children (every first token of the catalog), as a slice of the
    vocabulary when they are one run of consecutive ids (OpenOneRec's `<s_a_*>`):
    their LM-head rows are then a view, not a 16 MB gather every batch. The tables
    say so on the host (`root_run`): nothing is read back from the device."""
    if tables.root_run is None:
        return tables.tokens[0]
    return slice(*tables.root_run)


def _widths(values: list[int], device: torch.device) -> torch.Tensor | None:
    """Per-request widths as a tensor, or None when they are all equal (nothing to mask)."""
    if min(values) == max(values):
        return None
    return torch.tensor(values, device=device)


def _to_host(output: DeviceOutput, num_results: list[int]) -> StepOutput:
    """One copy back per tensor; on CUDA, one wait on an event of the current stream only."""
    tokens, scores, logprobs = output.tokens, output.scores, output.token_logprobs
    if tokens.device.type == "cuda":
        host = [t.to("cpu", non_blocking=True) for t in (tokens, scores, logprobs)]
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
    else:
        host = [tokens, scores, logprobs]
    return StepOutput(host[0].numpy(), host[1].numpy(), host[2].numpy(), num_results)
