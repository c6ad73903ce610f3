"""SASRec (Kang & McAuley 2018, "Self-Attentive Sequential Recommendation"): the sequential
baseline of `xrec eval`, written from the paper's description.

Follows the paper: item embedding (scaled by sqrt(hidden)) + learned positional embedding over
a left-padded, right-aligned window of the last `max_len` items; blocks of causal
self-attention and a point-wise feed-forward net, each as x + Dropout(f(LayerNorm(x))); a
final LayerNorm; the score of item i is the hidden state's dot product with item i's (shared)
input embedding.

Departs from it, on purpose:
- loss: the paper's binary cross-entropy against one sampled negative per position is replaced
  by a full softmax cross-entropy over all items at every position of the training sequence
  (teacher forcing), the variant that beats the sampled loss in later studies. It runs chunk
  by chunk with its gradient formed in the forward pass (`_SoftmaxCrossEntropy`): the
  [positions, items] logits never exist whole, faster on a CPU (docs/decisions.md, Real data);
- scores: cosine similarity over a temperature of 0.05 (hidden state and item embedding both
  L2-normalised), as in the published ML-1M configuration (generative-recommenders'
  `sasrec-sampled-softmax-n128-final.gin`: `user_embedding_norm = "l2_norm"`,
  `item_l2_norm`, `temperature = 0.05`); `temperature=None` is the paper's dot product;
- no dropout on the attention weights (it stays on the embeddings, the residual branches and
  the feed-forward net), so that PyTorch's fused CPU attention kernel runs;
- `random_crop`: a user whose training sequence is longer than the window trains on a random
  window of it each epoch rather than always on the last one;
- batches group users of similar length (less padding); validation HR@10 on the `valid`
  stage picks the epoch (early stopping; NDCG@10 breaks ties).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from xrec.engine.threads import FollowFreeCores, threads_in_this_thread, training_threads
from xrec.realdata.data.interactions import DataError, Split
from xrec.utils.progress import bar_disabled

__all__ = ["EpochLog", "SASRecConfig", "SASRecModel", "check_trainable", "rank_sasrec",
           "train_sasrec"]

L2_EPS = 1e-6
LOSS_CHUNK = 2048   # positions per chunk of the softmax cross-entropy ([2048, N] fp32 buffer)


@dataclass(frozen=True)
class SASRecConfig:
    """Model size and training schedule. The model is the paper's ML-1M one (2 blocks, 50
    dimensions, the last 200 items, dropout 0.2); it trains to convergence: early stopping on
    validation HR@10, with no wall-time cap unless `max_seconds` asks for one
    (docs/decisions.md, Real data)."""

    hidden_size: int = 50
    num_blocks: int = 2
    num_heads: int = 1
    max_len: int = 200              # window: the last `max_len` items of a sequence
    dropout: float = 0.2
    temperature: float | None = 0.05  # cosine scores / temperature; None: the paper's dot product
    epochs: int = 300               # at most: early stopping ends it first on ML-1M
    batch_size: int = 32            # users (windows) per step
    lr: float = 2e-3                # Adam
    weight_decay: float = 0.0
    patience: int = 10              # validations without a better HR@10 before stopping
    random_crop: bool = True        # a random window of longer sequences each epoch
    max_seconds: float | None = None  # stop after this much training time (not reproducible)
    seed: int = 0
    num_threads: int = 2            # torch CPU threads while training and ranking
    device: str = "cpu"

    def __post_init__(self):
        positive = ("hidden_size", "num_blocks", "num_heads", "max_len", "epochs",
                    "batch_size", "patience", "num_threads")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"SASRecConfig.{name}: got {getattr(self, name)}, expected >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"SASRecConfig.hidden_size: got {self.hidden_size}, expected a "
                             f"multiple of num_heads={self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"SASRecConfig.dropout: got {self.dropout}, expected in [0, 1)")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"SASRecConfig: got lr={self.lr}, weight_decay="
                             f"{self.weight_decay}, expected lr > 0 and weight_decay >= 0")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"SASRecConfig.temperature: got {self.temperature}, expected > 0 "
                             "or None")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"SASRecConfig.max_seconds: got {self.max_seconds}, "
                             "expected > 0 or None")


@dataclass(frozen=True)
class EpochLog:
    """One epoch of training: mean loss per position, validation HR@10 and NDCG@10 (None when
    the epoch was not validated) and the wall time since training started."""

    epoch: int
    loss: float
    valid_hr10: float | None
    valid_ndcg10: float | None
    seconds: float


class SelfAttention(nn.Module):
    def __init__(self, config: SASRecConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, length, h = x.shape
        qkv = self.qkv_proj(x).view(b, length, 3, self.num_heads, h // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                        # each [B, heads, L, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, L, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, length, h))


class Block(nn.Module):
    def __init__(self, config: SASRecConfig):
        super().__init__()
        h = config.hidden_size
        self.attn_norm = nn.LayerNorm(h)
        self.attn = SelfAttention(config)
        self.ffn_norm = nn.LayerNorm(h)
        self.ffn = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Dropout(config.dropout),
                                 nn.Linear(h, h))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), mask))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


class SASRecModel(nn.Module):
    """The network. Inputs are item indices shifted by one (0 = padding), left-padded so the
    most recent item sits at the last column; column j of a window of width L has position
    max_len - L + j. `epoch_logs` holds the training curve once trained."""

    def __init__(self, num_items: int, config: SASRecConfig):
        super().__init__()
        self.config = config
        self.num_items = num_items
        h = config.hidden_size
        self.item_emb = nn.Embedding(num_items + 1, h, padding_idx=0)
        self.pos_emb = nn.Embedding(config.max_len, h)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_blocks))
        self.norm = nn.LayerNorm(h)
        self.epoch_logs: list[EpochLog] = []
        nn.init.normal_(self.item_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] (L <= max_len, shifted ids) -> hidden states [B, L, H]."""
        b, length = input_ids.shape
        is_item = input_ids > 0                                       # [B, L]
        positions = torch.arange(self.config.max_len - length, self.config.max_len,
                                 device=input_ids.device)
        x = self.item_emb(input_ids) * math.sqrt(self.config.hidden_size) + self.pos_emb(positions)
        x = self.drop(x)                                              # [B, L, H]
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        # a query sees earlier items, never padding; padding sees itself (no empty softmax row)
        eye = torch.eye(length, dtype=torch.bool, device=input_ids.device)
        mask = (causal & is_item[:, None, :]) | eye                   # [B, L(query), L(key)]
        mask = mask[:, None]                                          # [B, 1, L, L]
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)

    def scoring(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [..., H], item vectors [num_items, H]) whose products are the scores:
        with a temperature, both L2-normalised and the queries divided by it (cosine / T);
        else the hidden states and the input embeddings as they are."""
        items = self.item_emb.weight[1:]
        if self.config.temperature is None:
            return hidden, items
        return (F.normalize(hidden, dim=-1, eps=L2_EPS) / self.config.temperature,
                F.normalize(items, dim=-1, eps=L2_EPS))

    def item_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> scores [..., num_items] (item index order, no padding column)."""
        queries, items = self.scoring(hidden)
        return queries @ items.T


class _SoftmaxCrossEntropy(torch.autograd.Function):
    """Summed softmax cross-entropy of `hidden @ weight.T` against `targets`, a chunk of
    positions at a time: the gradient is formed in the forward pass (the loss is the last node
    of the graph), so no [T, num_items] logits tensor is ever materialised. On a CPU this is
    faster than F.cross_entropy over full logits, which is memory-bound (docs/decisions.md, Real data)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        grad_hidden = torch.empty_like(hidden)                       # [T, H]
        grad_weight = torch.zeros_like(weight)                       # [N, H]
        total = hidden.new_zeros(())
        buffer = hidden.new_empty(min(chunk, len(hidden)), len(weight))  # [C, N]
        rows = torch.arange(len(buffer), device=hidden.device)
        for start in range(0, len(hidden), chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            n = len(h)
            logits = torch.mm(h, weight.T, out=buffer[:n])            # [n, N]
            target_logits = logits[rows[:n], t]
            peak = logits.amax(1, keepdim=True)
            probs = logits.sub_(peak).exp_()
            norm = probs.sum(1, keepdim=True)
            total += (norm.log() + peak).sum() - target_logits.sum()
            probs.div_(norm)[rows[:n], t] -= 1.0                      # d loss / d logits
            torch.mm(probs, weight, out=grad_hidden[start:start + n])
            grad_weight.addmm_(probs.T, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_total, grad_weight * grad_total, None, None


def _windows(seqs: list[np.ndarray], max_len: int, rng: np.random.Generator | None) -> np.ndarray:
    """int64 [len(seqs), max_len]: the last max_len items of each sequence (with rng: a
    window ending at a random point, at least max_len items in) shifted by one, left-padded."""
    out = np.zeros((len(seqs), max_len), np.int64)
    for row, seq in enumerate(seqs):
        end = len(seq)
        if rng is not None and end > max_len:
            end = int(rng.integers(max_len, end + 1))
        window = seq[max(0, end - max_len):end]
        out[row, max_len - len(window):] = window.astype(np.int64) + 1
    return out


def _batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Row indices of each batch: rows shuffled, then sorted by length within groups of 16
    batches (so a batch pads to about its own longest row), batches in random order."""
    order = rng.permutation(len(lengths))
    group = 16 * batch_size
    for start in range(0, len(order), group):
        chunk = order[start:start + group]
        order[start:start + group] = chunk[np.argsort(lengths[chunk], kind="stable")]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def _trimmed(batch: np.ndarray) -> np.ndarray:
    """Drop the columns that are padding in every row (left padding: a prefix of columns)."""
    width = int((batch > 0).sum(1).max())
    return batch[:, batch.shape[1] - max(width, 1):]


def _padded(seqs: list[np.ndarray]) -> np.ndarray:
    """int64 [len(seqs), longest]: whole sequences shifted by one, right-padded with 0."""
    lengths = np.array([len(s) for s in seqs])
    out = np.zeros((len(seqs), max(1, lengths.max(initial=0))), np.int64)
    rows = np.repeat(np.arange(len(seqs)), lengths)
    cols = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, cols] = np.concatenate(seqs).astype(np.int64) + 1
    return out


@torch.inference_mode()
def rank_sasrec(model: SASRecModel, split: Split, stage: str, k: int,
                exclude_seen: bool = False, batch_size: int = 256) -> np.ndarray:
    """int64 [num_users, k]: each user's top-k item indices, best first, given the user's
    `split.history(stage)` (its last max_len items). exclude_seen: no item of the whole
    history is returned (a user who has seen all but fewer than k items gets -1 or seen items
    at the end of the row). Users with no target (-1) are ranked too. A catalog of fewer than
    k items: every item ranked, the rest of the row -1 (as the baselines' `_rank`)."""
    if k < 1:
        raise ValueError(f"k: got {k}, expected >= 1")
    num_kept = min(k, model.num_items)
    history = split.history(stage)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with threads_in_this_thread(min(torch.get_num_threads(), model.config.num_threads)):
            # users in order of history length, so that a batch pads only to its own longest
            order = np.argsort([len(h) for h in history], kind="stable")
            ranked = np.full((len(history), k), -1, np.int64)
            for start in range(0, len(order), batch_size):
                users = order[start:start + batch_size]
                seqs = [history[u] for u in users]
                inputs = torch.from_numpy(_trimmed(_windows(seqs, model.config.max_len, None)))
                hidden = model(inputs.to(device))[:, -1]                  # [B, H]
                scores = F.pad(model.item_scores(hidden), (1, 0), value=-torch.inf)  # [B, 1 + N]
                if exclude_seen:
                    scores.scatter_(1, torch.from_numpy(_padded(seqs)).to(device), -torch.inf)
                best = scores.topk(num_kept, dim=1).indices - 1                 # [B, k']
                ranked[users, :num_kept] = best.cpu().numpy()
            return ranked
    finally:
        model.train(was_training)


def _hr_ndcg(ranked: np.ndarray, targets: np.ndarray) -> tuple[float, float]:
    """HR and NDCG at ranked.shape[1] over the users with a target (one relevant item)."""
    evaluated = targets >= 0
    hits = ranked[evaluated] == targets[evaluated, None]              # [U, k]
    gains = hits / np.log2(np.arange(2, ranked.shape[1] + 2))
    return float(hits.any(1).mean()), float(gains.sum(1).mean())


def check_trainable(split: Split) -> None:
    """DataError unless SASRec can train on `split` and stop early: a user with a test item,
    and one with 2 training items (its first target is a sequence's second item)."""
    split.check_evaluated("SASRec stops early on their validation items (semantic IDs of "
                          "such data: --embeddings svd)")
    if not any(len(s) >= 2 for s in split.train):
        raise DataError("SASRec: no user has 2 or more training interactions (its first "
                        "target is a sequence's second item): leave it out of xrec eval "
                        "with --baselines most-popular,item-knn; semantic IDs of such data: "
                        "--embeddings svd")


def train_sasrec(split: Split, config: SASRecConfig, progress: bool = True,
                 valid_every: int = 1) -> SASRecModel:
    """Train on each user's training sequence (next-item CE at every position), validate
    HR@10 on the `valid` stage every `valid_every` epochs, stop after `config.patience`
    validations without improvement, and return the model with the best weights (eval mode,
    `epoch_logs` filled)."""
    if valid_every < 1:
        raise ValueError(f"valid_every: got {valid_every}, expected >= 1")
    check_trainable(split)
    seqs = [s for s in split.train if len(s) >= 2]
    with training_threads(config.num_threads) as cores:
        return _train(split, seqs, config, progress, valid_every, cores)


def _train(split: Split, seqs: list[np.ndarray], config: SASRecConfig, progress: bool,
           valid_every: int, cores: FollowFreeCores) -> SASRecModel:
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    model = SASRecModel(split.data.num_items, config).to(config.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr,
                                 weight_decay=config.weight_decay)
    has_valid = bool((split.valid >= 0).any())
    best, best_state, stale = (-1.0, -1.0), None, 0
    logs: list[EpochLog] = []
    started = time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        model.train()
        # one window of max_len + 1 items per user: inputs are its first max_len, targets the last
        windows = _windows(seqs, config.max_len + 1, rng if config.random_crop else None)
        batches = _batches((windows > 0).sum(1), config.batch_size, rng)
        total_loss, total_positions = 0.0, 0
        bar = tqdm(batches, desc=f"sasrec epoch {epoch}/{config.epochs}",
                   disable=bar_disabled(progress), leave=False, unit="batch")
        epoch_started = time.perf_counter()
        for rows in bar:
            cores.follow()
            batch = torch.from_numpy(_trimmed(windows[rows])).to(config.device)
            inputs, targets = batch[:, :-1], batch[:, 1:] - 1         # [B, L] each
            is_trained = inputs > 0                                   # target is an item too
            hidden = model(inputs)[is_trained]                        # [T, H]
            num_positions = int(is_trained.sum())
            loss = _SoftmaxCrossEntropy.apply(*model.scoring(hidden),
                                              targets[is_trained], LOSS_CHUNK) / num_positions
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * num_positions
            total_positions += num_positions
            rate = total_positions / max(time.perf_counter() - epoch_started, 1e-9)
            bar.set_postfix(loss=f"{total_loss / total_positions:.4f}", pos_s=f"{rate:.0f}")
        bar.close()
        hr = ndcg = None
        if has_valid and (epoch % valid_every == 0 or epoch == config.epochs):
            hr, ndcg = _hr_ndcg(rank_sasrec(model, split, "valid", 10), split.valid)
        logs.append(EpochLog(epoch, total_loss / max(total_positions, 1), hr, ndcg,
                             time.perf_counter() - started))
        if progress:
            tqdm.write(f"sasrec epoch {epoch}: loss {logs[-1].loss:.4f}"
                       + (f", valid HR@10 {hr:.4f} NDCG@10 {ndcg:.4f}" if hr is not None else "")
                       + f", {logs[-1].seconds:.0f} s")
        if hr is not None:
            if (hr, ndcg) > best:  # NDCG@10 breaks ties (HR@10 saturates on easy data)
                best, best_state, stale = (hr, ndcg), copy.deepcopy(model.state_dict()), 0
            else:
                stale += 1
                if stale >= config.patience:
                    break
        if config.max_seconds is not None and logs[-1].seconds >= config.max_seconds:
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.epoch_logs = logs
    return model.eval()
