"""A plain, slow, obviously-correct reference of the OneRec network and of its
fixed-round constrained beam search. Test oracle only: written for clarity,
independently of the engine (`xrec.model`, `xrec.search`), and never fast.

* The network (`NaiveOneRec`) follows docs/model.md: T5-v1.1
  encoder-decoder, RMSNorm, gated-SiLU FFN, optional decoder MoE, GQA, T5
  relative position bias (or none in absolute mode), tied or untied LM head.
  Everything runs in float64, one request at a time, no padding, no KV cache:
  `decoder_logits` recomputes the whole decoder sequence on every call, and
  attention is a plain softmax over all keys, one head at a time.
* The search (`naive_beam_search`) follows docs/beam-search.md and the
  "Constrained decoding" section of docs/catalog.md: per-beam copies of
  everything, a full decoder recompute per beam per round, candidates sorted
  by (-score, parent beam index, token id). The search itself
  (`fixed_round_beam_search`) only asks for the next-token logits of a beam,
  so the decoder-only reference (naive_causal.py) runs the same rounds.

The state dict uses the canonical (Hugging Face T5) tensor names, without a
prefix; see `tests/oracles/weights.py` for a random one and for renaming to
the other names the engine accepts.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch

from xrec.config import ModelConfig

__all__ = [
    "NaiveOneRec",
    "naive_beam_search",
    "fixed_round_beam_search",
    "relative_position_bucket",
    "rms_norm",
    "gated_silu_ffn",
    "moe_ffn",
    "build_trie",
    "round_log_probs",
    "assert_beams_close",
]


# ---------------------------------------------------------------------------
# building blocks (one token row or a [T, D] matrix; float64)
# ---------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """T5 RMSNorm: x * rsqrt(mean(x^2) + eps) * w. No mean subtraction, no bias."""
    variance = (x * x).mean(dim=-1, keepdim=True)
    return x / torch.sqrt(variance + eps) * weight


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def gated_silu_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down( silu(gate(x)) * up(x) ), weights [out, in]."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe_ffn(x: torch.Tensor, router: torch.Tensor, experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
            *, topk: int, route_scale: float,
            shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decoder mixture of experts, one token row at a time.

    weights = softmax over ALL experts' router logits; the top-k experts
    (ties: lower expert index) each contribute weight * route_scale *
    expert(x), with NO renormalisation over the chosen k; the shared experts
    (one gated FFN) are added ungated.
    `experts[e]` = (gate/w1, up/w3, down/w2); `shared` likewise or None.
    """
    rows = []
    for row in x.reshape(-1, x.shape[-1]):
        router_logits = router @ row                      # [E]
        probs = torch.softmax(router_logits, dim=-1)      # over all E
        order = sorted(range(len(experts)), key=lambda e: (-float(probs[e]), e))
        out = torch.zeros_like(row)
        for e in order[:topk]:
            gate, up, down = experts[e]
            out = out + probs[e] * route_scale * gated_silu_ffn(row, gate, up, down)
        if shared is not None:
            out = out + gated_silu_ffn(row, *shared)
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


def relative_position_bucket(relative_position: int, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> int:
    """Hugging Face T5's bucketing of relative_position = key_pos - query_pos.

    Bidirectional (encoder): half the buckets for keys at or before the
    query, half for keys after it. Unidirectional (decoder): only keys at or
    before the query count (later ones, masked anyway, fall in bucket 0).
    Within a half, the first `max_exact` distances get their own bucket and
    the rest are log-spaced up to `max_distance`, clipped to the last bucket.
    The log is computed in float32 exactly as Hugging Face does, so boundary
    cases round the same way.
    """
    bucket = 0
    n = num_buckets
    if bidirectional:
        n //= 2
        if relative_position > 0:
            bucket += n
        distance = abs(relative_position)
    else:
        distance = -min(relative_position, 0)
    max_exact = n // 2
    if distance < max_exact:
        return bucket + distance
    # Same float32 arithmetic as transformers' T5Attention._relative_position_bucket.
    ratio = torch.tensor(float(distance), dtype=torch.float32) / max_exact
    scaled = torch.log(ratio) / math.log(max_distance / max_exact) * (n - max_exact)
    large = max_exact + int(scaled.to(torch.long))
    return bucket + min(large, n - 1)


def attention(x_q: torch.Tensor, x_kv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
              wo: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
              bias: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """One-stage multi-head attention, one head at a time.

    x_q [Tq, D], x_kv [Tk, D]; bias [heads, Tq, Tk] or None. GQA: query head h
    reads kv head h // (num_heads // num_kv_heads). Causal: query i sees keys
    0..i (query and key positions both count from 0).
    """
    tq, tk = x_q.shape[0], x_kv.shape[0]
    group = num_heads // num_kv_heads
    q = (x_q @ wq.T).reshape(tq, num_heads, head_dim)
    k = (x_kv @ wk.T).reshape(tk, num_kv_heads, head_dim)
    v = (x_kv @ wv.T).reshape(tk, num_kv_heads, head_dim)
    outputs = []
    for h in range(num_heads):
        j = h // group
        scores = (q[:, h, :] @ k[:, j, :].T) * scale          # [Tq, Tk]
        if bias is not None:
            scores = scores + bias[h]
        if causal:
            for i in range(tq):
                for t in range(tk):
                    if t > i:
                        scores[i, t] = -math.inf
        probs = torch.softmax(scores, dim=-1)
        outputs.append(probs @ v[:, j, :])                   # [Tq, head_dim]
    return torch.cat(outputs, dim=-1) @ wo.T


# ---------------------------------------------------------------------------
# the network
# ---------------------------------------------------------------------------

class StateDictWeights:
    """Checked access to a float64 state dict `self.sd` (both naive networks use it)."""

    sd: dict[str, torch.Tensor]

    def w(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise KeyError(f"state dict has no tensor {name!r}")
        return self.sd[name]

    def _expect(self, name: str, shape: tuple[int, ...]) -> None:
        got = tuple(self.w(name).shape)
        if got != shape:
            raise ValueError(f"tensor {name!r}: shape {got}, expected {shape}")


class NaiveOneRec(StateDictWeights):
    """The OneRec network in float64, one request at a time, no cache.

    `state_dict` has canonical Hugging Face T5 names (no prefix). Extra
    tensors (e.g. Hugging Face's `encoder.embed_tokens.weight`, or a tied
    `lm_head.weight`) are ignored; a missing or mis-shaped one is a KeyError /
    ValueError naming it.
    """

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor]):
        self.config = config
        self.sd = {name: t.detach().to(torch.float64).clone() for name, t in state_dict.items()
                   if torch.is_tensor(t) and t.is_floating_point()}
        self._check_shapes()

    def _check_shapes(self) -> None:
        c = self.config
        d, v = c.d_model, c.vocab_size
        self._expect("shared.weight", (v, d))
        if not c.tie_word_embeddings:
            self._expect("lm_head.weight", (v, d))
        stacks = (("encoder", c.num_encoder_layers, c.num_heads, c.num_kv_heads, c.head_dim),
                  ("decoder", c.num_decoder_layers, c.decoder_num_heads, c.decoder_num_kv_heads,
                   c.decoder_head_dim))
        for stack, layers, heads, kv, hd in stacks:
            self._expect(f"{stack}.final_layer_norm.weight", (d,))
            if not c.use_absolute_position_embedding:
                self._expect(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                             (c.relative_attention_num_buckets, heads))
            for i in range(layers):
                p = f"{stack}.block.{i}.layer"
                attns = [f"{p}.0.SelfAttention"] + ([f"{p}.1.EncDecAttention"] if stack == "decoder" else [])
                for n, a in enumerate(attns):
                    self._expect(f"{p}.{n}.layer_norm.weight", (d,))
                    self._expect(f"{a}.q.weight", (heads * hd, d))
                    self._expect(f"{a}.k.weight", (kv * hd, d))
                    self._expect(f"{a}.v.weight", (kv * hd, d))
                    self._expect(f"{a}.o.weight", (d, heads * hd))
                f = f"{p}.{len(attns)}"
                self._expect(f"{f}.layer_norm.weight", (d,))
                if stack == "decoder" and c.use_moe:
                    m = c.moe_inter_dim
                    self._expect(f"{f}.ffn.gate.weight", (c.moe_num_experts, d))
                    for e in range(c.moe_num_experts):
                        self._expect(f"{f}.ffn.experts.{e}.w1.weight", (m, d))
                        self._expect(f"{f}.ffn.experts.{e}.w3.weight", (m, d))
                        self._expect(f"{f}.ffn.experts.{e}.w2.weight", (d, m))
                    if c.moe_use_shared_experts:
                        s = m * c.moe_num_shared_experts
                        self._expect(f"{f}.ffn.shared_experts.w1.weight", (s, d))
                        self._expect(f"{f}.ffn.shared_experts.w3.weight", (s, d))
                        self._expect(f"{f}.ffn.shared_experts.w2.weight", (d, s))
                else:
                    self._expect(f"{f}.DenseReluDense.wi_0.weight", (c.d_ff, d))
                    self._expect(f"{f}.DenseReluDense.wi_1.weight", (c.d_ff, d))
                    self._expect(f"{f}.DenseReluDense.wo.weight", (d, c.d_ff))

    # ---- pieces ----------------------------------------------------------------

    def embed(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        return self.w("shared.weight")[ids]

    def position_bias(self, stack: str, query_len: int, key_len: int) -> torch.Tensor | None:
        """[heads, Tq, Tk] relative bias of a stack's self-attention, None in absolute mode."""
        c = self.config
        if c.use_absolute_position_embedding:
            return None
        table = self.w(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        heads = table.shape[1]
        bias = torch.zeros(heads, query_len, key_len, dtype=torch.float64)
        for i in range(query_len):
            for j in range(key_len):
                bucket = relative_position_bucket(j - i, bidirectional=(stack == "encoder"),
                                                  num_buckets=c.relative_attention_num_buckets,
                                                  max_distance=c.relative_attention_max_distance)
                bias[:, i, j] = table[bucket]
        return bias

    def _attn(self, prefix: str, x_q, x_kv, *, decoder: bool, bias, causal: bool) -> torch.Tensor:
        c = self.config
        if decoder:
            heads, kv, hd, scale = c.decoder_num_heads, c.decoder_num_kv_heads, c.decoder_head_dim, c.attention_scale
        else:
            heads, kv, hd, scale = c.num_heads, c.num_kv_heads, c.head_dim, c.encoder_attention_scale
        return attention(x_q, x_kv, self.w(f"{prefix}.q.weight"), self.w(f"{prefix}.k.weight"),
                         self.w(f"{prefix}.v.weight"), self.w(f"{prefix}.o.weight"),
                         num_heads=heads, num_kv_heads=kv, head_dim=hd, scale=scale, bias=bias, causal=causal)

    def _dense_ffn(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        return gated_silu_ffn(x, self.w(f"{prefix}.DenseReluDense.wi_0.weight"),
                              self.w(f"{prefix}.DenseReluDense.wi_1.weight"),
                              self.w(f"{prefix}.DenseReluDense.wo.weight"))

    def _moe(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        experts = [(self.w(f"{prefix}.ffn.experts.{e}.w1.weight"), self.w(f"{prefix}.ffn.experts.{e}.w3.weight"),
                    self.w(f"{prefix}.ffn.experts.{e}.w2.weight")) for e in range(c.moe_num_experts)]
        shared = None
        if c.moe_use_shared_experts:
            shared = (self.w(f"{prefix}.ffn.shared_experts.w1.weight"),
                      self.w(f"{prefix}.ffn.shared_experts.w3.weight"),
                      self.w(f"{prefix}.ffn.shared_experts.w2.weight"))
        return moe_ffn(x, self.w(f"{prefix}.ffn.gate.weight"), experts, topk=c.moe_topk,
                       route_scale=c.moe_route_scale, shared=shared)

    # ---- stacks ----------------------------------------------------------------

    def encode(self, token_ids=None, sparse_embedding=None) -> torch.Tensor:
        """Encoder output [L, D] (after final_layer_norm) of one request."""
        if (token_ids is None) == (sparse_embedding is None):
            raise ValueError("give exactly one of token_ids and sparse_embedding")
        c = self.config
        if token_ids is not None:
            h = self.embed(token_ids)
        else:
            h = torch.as_tensor(sparse_embedding).to(torch.float64).reshape(-1, c.d_model).clone()
        length = h.shape[0]
        bias = self.position_bias("encoder", length, length)
        eps = c.layer_norm_epsilon
        for i in range(c.num_encoder_layers):
            p = f"encoder.block.{i}.layer"
            x = rms_norm(h, self.w(f"{p}.0.layer_norm.weight"), eps)
            h = h + self._attn(f"{p}.0.SelfAttention", x, x, decoder=False, bias=bias, causal=False)
            x = rms_norm(h, self.w(f"{p}.1.layer_norm.weight"), eps)
            h = h + self._dense_ffn(f"{p}.1", x)
        return rms_norm(h, self.w("encoder.final_layer_norm.weight"), eps)

    def decoder_hidden(self, encoder_output: torch.Tensor, decoder_input_embeds: torch.Tensor) -> torch.Tensor:
        """Decoder output [T, D] (after final_layer_norm), full recompute."""
        c = self.config
        enc = torch.as_tensor(encoder_output).to(torch.float64)
        h = torch.as_tensor(decoder_input_embeds).to(torch.float64).reshape(-1, c.d_model).clone()
        length = h.shape[0]
        bias = self.position_bias("decoder", length, length)
        eps = c.layer_norm_epsilon
        for i in range(c.num_decoder_layers):
            p = f"decoder.block.{i}.layer"
            x = rms_norm(h, self.w(f"{p}.0.layer_norm.weight"), eps)
            h = h + self._attn(f"{p}.0.SelfAttention", x, x, decoder=True, bias=bias, causal=True)
            x = rms_norm(h, self.w(f"{p}.1.layer_norm.weight"), eps)
            h = h + self._attn(f"{p}.1.EncDecAttention", x, enc, decoder=True, bias=None, causal=False)
            x = rms_norm(h, self.w(f"{p}.2.layer_norm.weight"), eps)
            h = h + (self._moe(f"{p}.2", x) if c.use_moe else self._dense_ffn(f"{p}.2", x))
        return rms_norm(h, self.w("decoder.final_layer_norm.weight"), eps)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.tie_word_embeddings:
            scale = c.d_model ** -0.5 if c.scale_decoder_outputs else 1.0
            return (hidden * scale) @ self.w("shared.weight").T
        return hidden @ self.w("lm_head.weight").T

    def decoder_logits(self, encoder_output: torch.Tensor, decoder_input_embeds: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] of every decoder position, recomputing the whole sequence."""
        return self.lm_head(self.decoder_hidden(encoder_output, decoder_input_embeds))

    def decoder_prefix(self, decoder_context_embedding=None) -> torch.Tensor:
        """Round 0's decoder input: the context rows, or the embedded BOS token."""
        if decoder_context_embedding is not None:
            return torch.as_tensor(decoder_context_embedding).to(torch.float64).reshape(-1, self.config.d_model)
        return self.embed([self.config.bos_token_id])


# ---------------------------------------------------------------------------
# constrained fixed-round beam search
# ---------------------------------------------------------------------------

def build_trie(catalog_triples: Iterable[Sequence[int]], rounds: int) -> dict[tuple[int, ...], set[int]]:
    """prefix (tuple, length 0..rounds-1) -> set of allowed next tokens."""
    trie: dict[tuple[int, ...], set[int]] = {}
    for triple in catalog_triples:
        triple = tuple(int(t) for t in triple)
        if len(triple) != rounds:
            raise ValueError(f"catalog entry {triple} has length {len(triple)}, expected {rounds}")
        for r in range(rounds):
            trie.setdefault(triple[:r], set()).add(triple[r])
    return trie


def round_log_probs(logits: torch.Tensor, allowed: Iterable[int] | None, normalize: str) -> dict[int, float]:
    """Per-token log-probabilities of one beam's round: token -> lp, allowed tokens only.

    "allowed": lp = x[allowed] - logsumexp(x[allowed]);
    "full":    lp = log_softmax(x over the whole vocab), then disallowed removed.
    `allowed` None means no constraint (every token; both modes agree).
    """
    x = logits.to(torch.float64)
    vocab = x.shape[-1]
    tokens = sorted(range(vocab) if allowed is None else allowed)
    if not tokens:
        return {}
    if normalize == "full":
        lse = torch.logsumexp(x, dim=-1)
    elif normalize == "allowed":
        lse = torch.logsumexp(x[tokens], dim=-1)
    else:
        raise ValueError(f"normalize: got {normalize!r}, allowed: 'allowed', 'full'")
    return {t: float(x[t] - lse) for t in tokens}


def fixed_round_beam_search(next_logits: Callable[[tuple[int, ...]], torch.Tensor], *, beam_width: int,
                            num_return_sequences: int | None = None, normalize: str = "allowed",
                            catalog_triples=None, rounds: int = 3,
                            temperature: float = 1.0) -> list[tuple[tuple[int, ...], float, list[float]]]:
    """The fixed-round beam search of one request, per docs/beam-search.md,
    whatever the network: `next_logits(tokens)` returns the logits [V] of the
    token that follows the generated `tokens` (a tuple, () in round 0).

    Returns up to N = num_return_sequences (default W; any N >= 1) results
    (tokens, score, per-round log-probs), best first. Round r keeps the best
    W (the best N in the last round, N < W, = W or > W) of all finite
    candidates of all beams, ordered by (-score, parent beam index, token id);
    -inf candidates never survive, so fewer results come back when fewer
    finite candidates exist. `temperature` divides the logits (0 means 1).
    """
    w = int(beam_width)
    n = w if num_return_sequences is None else int(num_return_sequences)
    if w < 1 or n < 1:
        raise ValueError(f"need beam_width >= 1 and num_return_sequences >= 1, got W={w}, N={n}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    temp = 1.0 if not temperature else float(temperature)
    if temp < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    trie = None if catalog_triples is None else build_trie(catalog_triples, rounds)

    # a beam: (tokens, score, per-round log-probs)
    beams: list[tuple[tuple[int, ...], float, list[float]]] = [((), 0.0, [])]
    for r in range(rounds):
        keep = n if r == rounds - 1 else w
        candidates = []  # (score, parent, token, tokens, lps)
        for parent, (tokens, score, lps) in enumerate(beams):
            logits = next_logits(tokens) / temp
            allowed = None if trie is None else trie.get(tokens, set())
            for token, lp in round_log_probs(logits, allowed, normalize).items():
                new_score = score + lp
                if math.isfinite(new_score):
                    candidates.append((new_score, parent, token, tokens + (token,), lps + [lp]))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = [(c[3], c[0], c[4]) for c in candidates[:keep]]
        if not beams:
            break
    return beams


def naive_beam_search(model: NaiveOneRec, *, token_ids=None, sparse_embedding=None, decoder_context_embedding=None,
                      beam_width: int, num_return_sequences: int | None = None, normalize: str = "allowed",
                      catalog_triples=None, rounds: int = 3,
                      temperature: float = 1.0) -> list[tuple[tuple[int, ...], float, list[float]]]:
    """Fixed-round beam search of one OneRec request (`fixed_round_beam_search`):
    a full decoder recompute per beam per round over the decoder prefix (BOS
    or context rows) and the beam's generated tokens."""
    encoder_output = model.encode(token_ids=token_ids, sparse_embedding=sparse_embedding)
    prefix = model.decoder_prefix(decoder_context_embedding)

    def next_logits(tokens: tuple[int, ...]) -> torch.Tensor:
        decoder_input = torch.cat([prefix, model.embed(list(tokens))], dim=0) if tokens else prefix
        return model.decoder_logits(encoder_output, decoder_input)[-1]

    return fixed_round_beam_search(next_logits, beam_width=beam_width, num_return_sequences=num_return_sequences,
                                   normalize=normalize, catalog_triples=catalog_triples, rounds=rounds,
                                   temperature=temperature)


# ---------------------------------------------------------------------------
# comparing beam results
# ---------------------------------------------------------------------------

def assert_beams_close(actual, expected, *, atol: float = 1e-4, tie_tol: float = 1e-5, what: str = "") -> None:
    """Assert two best-first result lists agree: same length, scores within
    `atol`, tokens equal position by position, except that results whose
    expected scores lie within `tie_tol` of each other may come in either
    order (near-ties are float-rounding dependent). Items are (tokens, score,
    ...) tuples; extra fields are ignored."""
    tag = f"{what}: " if what else ""
    assert len(actual) == len(expected), f"{tag}{len(actual)} results, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(float(a[1]) - float(e[1])) <= atol, (
            f"{tag}result {i}: score {float(a[1])!r}, expected {float(e[1])!r} (tokens {tuple(a[0])} vs "
            f"{tuple(e[0])})")
    i = 0
    while i < len(expected):
        j = i + 1
        while j < len(expected) and abs(float(expected[j][1]) - float(expected[i][1])) <= tie_tol:
            j += 1
        got = sorted(tuple(int(t) for t in a[0]) for a in actual[i:j])
        want = sorted(tuple(int(t) for t in e[0]) for e in expected[i:j])
        assert got == want, f"{tag}results {i}..{j - 1}: tokens {got}, expected {want}"
        i = j
