"""Hugging Face `transformers` Qwen2 / Qwen3 / Qwen3-MoE causal LMs as an
oracle for the decoder-only family and its beam search. Test helper:
`transformers` is imported lazily inside the functions (tests should
`pytest.importorskip("transformers")` first).

Facts about transformers 5.24 these helpers rely on (checked in
tests/test_oracles_causal.py):

* `save_pretrained` writes the theta as `"rope_parameters": {"rope_theta": θ,
  "rope_type": "default"}` (no top-level `rope_theta`, no `rope_scaling`),
  `"head_dim"` (Qwen2 too, which has no such field but honours it),
  `"use_sliding_window": false, "sliding_window": null`, for Qwen2 / Qwen3
  `"layer_types": ["full_attention", ...]` and `"max_window_layers": 28`,
  and for Qwen3-MoE `"num_local_experts"` (Qwen3MoeConfig maps
  `num_experts` to it through `attribute_map`; config.json has no
  `num_experts`) and `"mlp_only_layers": [...]`.
* Qwen3-MoE's experts default to the "grouped_mm" kernel
  (`config._experts_implementation`), which refuses float64;
  `make_hf_causal` sets "eager": the plain per-expert loop of
  modeling_qwen3_moe.py. Not written to config.json.
* Qwen3-MoE keeps its experts fused in memory (`mlp.experts.gate_up_proj`
  [E, 2·I, D], gate rows first, then up; `mlp.experts.down_proj` [E, D, I])
  but `save_pretrained` writes them per expert, under the checkpoint names
  `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` [I, D], [I, D],
  [D, I]; the router is `model.layers.N.mlp.gate.weight` [E, D]. Routing:
  softmax over all experts in float32, `torch.topk`, divided by the sum of
  the k weights only when `norm_topk_prob`.
* Qwen2's q/k/v projections always carry a bias, o_proj never. Qwen3 and
  Qwen3-MoE give q, k, v AND o a bias when `attention_bias` (o too, unlike
  Qwen2). Qwen3's q_norm / k_norm are RMSNorms over head_dim applied per
  head before RoPE.
* A tied model saves no `lm_head.weight` (`lm_head.weight` is
  `model.embed_tokens.weight` in memory); logits are `h @ embed.T`, no scale.
* No EOS: `make_hf_causal` sets eos_token_id and bos_token_id None and
  pad_token_id `PAD` (0) in config and generation config (the saved
  generation_config.json holds only `pad_token_id`), and
  `hf_causal_beam_search` also passes `eos_token_id=None` to `generate`, so no
  beam ends before `max_new_tokens`.
* For a decoder-only model, `generate` builds `position_ids` from the 2-D
  attention mask (`cumsum(mask) - 1`, pads set to 0) and continues them by +1
  per new token: with LEFT padding, each prompt's RoPE positions start at 0
  and the generated tokens of request b sit at len_b, len_b + 1, ...
  (`hf_causal_beam_search` asserts this by capturing the position ids that
  reach the rotary embedding). RoPE is shift-invariant in exact arithmetic,
  so a wrong offset would only show up as rounding: hence the direct check.
* Beam search applies `prefix_allowed_tokens_fn` to the log-softmax over the
  whole vocabulary (xrec's `normalize="full"`), passes the WHOLE row
  (left-padded prompt + generated tokens) to the function, seeds beams
  1..W-1 with score -1e9, and with `length_penalty=0.0` a sequence's
  `sequences_scores` is the plain sum of its per-step log-probabilities.
  `num_return_sequences` must be <= `num_beams`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from oracles.hf import build_trie

__all__ = ["make_hf_causal", "hf_causal_logits", "hf_causal_beam_search", "causal_prefix_allowed_tokens_fn", "PAD",
           "KINDS"]

PAD = 0
KINDS = ("qwen2", "qwen3", "qwen3_moe")


def make_hf_causal(tmp_dir, *, kind: str, seed: int, vocab_size: int = 96, hidden_size: int = 32,
                   num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8,
                   intermediate_size: int = 48, tie_word_embeddings: bool = True, attention_bias: bool = False,
                   rope_theta: float = 10000.0, num_experts: int = 4, num_experts_per_tok: int = 2,
                   moe_intermediate_size: int = 16, norm_topk_prob: bool = False, decoder_sparse_step: int = 1,
                   mlp_only_layers=(), rms_norm_eps: float = 1e-6, max_position_embeddings: int = 512,
                   std: float = 0.25, embedding_std: float = 0.25, lm_head_std: float = 0.25, bias_std: float = 0.5,
                   router_std: float = 0.3):
    """A random `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`
    (`kind` "qwen2", "qwen3", "qwen3_moe"; eval, float32, eager attention),
    deterministic from `seed`, saved with safetensors in `tmp_dir`.

    Weights (every parameter re-drawn): linear and expert weights ~ N(0, std);
    embed_tokens ~ N(0, embedding_std); untied lm_head ~ N(0, lm_head_std);
    attention biases (qwen2 always; qwen3 / qwen3_moe when attention_bias,
    o_proj included there) ~ N(0, bias_std); MoE router ~ N(0, router_std):
    router logits of std ~1.7, spread enough that float32 and float64 pick
    the same top-k, flat enough that the second expert and `norm_topk_prob`
    change the logits by O(1) (router_std 1.0 makes one expert dominate:
    flipping norm_topk_prob then moves logits by ~0.02 only); RMSNorm weights
    (incl. q_norm / k_norm) ~ 1 + N(0, 0.2).
    With the defaults (logits of std ~1.4: sqrt(hidden) * 0.25) the top token
    of a position has a log-prob of -1.5 to -2.1 on average, between about -3
    and -0.5 (not ~0: beams stay in play; embedding_std 0.5 gives ~-0.9 with
    many ~0), and float32 Hugging Face logits agree with a float64 recompute
    to <= 1.4e-6 relative (max |err| / max |logit|, prompts of 1..100 tokens;
    tests/test_oracles_causal.py asserts <= 2e-5). std 0.5 gives up to 5e-6.
    Generation never stops early: eos_token_id and bos_token_id are None in
    config and generation config; pad_token_id = `PAD` (0): keep it out of
    catalogs.

    Returns (model, directory).
    """
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    if kind not in KINDS:
        raise ValueError(f"kind: got {kind!r}, allowed: {KINDS}")
    directory = Path(tmp_dir)
    directory.mkdir(parents=True, exist_ok=True)
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        rms_norm_eps=rms_norm_eps, max_position_embeddings=max_position_embeddings, use_sliding_window=False,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None, attention_dropout=0.0,
    )
    if kind == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif kind == "qwen3":
        config, cls = Qwen3Config(**common, attention_bias=attention_bias), Qwen3ForCausalLM
    else:
        config = Qwen3MoeConfig(**common, attention_bias=attention_bias, num_experts=num_experts,
                                num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
                                norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
                                mlp_only_layers=list(mlp_only_layers))
        cls = Qwen3MoeForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)  # the constructor's own init; every weight is overwritten below anyway
    model = cls(config)
    if kind == "qwen3_moe":
        # the plain per-expert loop of modeling_qwen3_moe.py, not the default "grouped_mm" kernel
        model.set_experts_implementation("eager")
        assert model.config._experts_implementation == "eager"
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        seen = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name.endswith("norm.weight"):          # input/post_attention_layernorm, q_norm, k_norm, model.norm
                value = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                value = bias_std * torch.randn(p.shape, generator=gen)
            elif name == "model.embed_tokens.weight":
                value = embedding_std * torch.randn(p.shape, generator=gen)
            elif name == "lm_head.weight":
                value = lm_head_std * torch.randn(p.shape, generator=gen)
            elif name.endswith("mlp.gate.weight"):    # MoE router
                value = router_std * torch.randn(p.shape, generator=gen)
            else:
                value = std * torch.randn(p.shape, generator=gen)
            p.copy_(value.to(p.dtype))
    model = model.float().eval()
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = None
        cfg.bos_token_id = None
        cfg.pad_token_id = PAD
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(tie_word_embeddings)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model, directory


# ---------------------------------------------------------------------------
# forward and search
# ---------------------------------------------------------------------------

@torch.no_grad()
def hf_causal_logits(model, token_ids) -> torch.Tensor:
    """float32 logits [T, V] of every position of one unpadded prompt (positions 0..T-1)."""
    ids = torch.as_tensor(list(token_ids) if not torch.is_tensor(token_ids) else token_ids,
                          dtype=torch.long).reshape(1, -1)
    return model(input_ids=ids, use_cache=False, return_dict=True).logits[0]


def causal_prefix_allowed_tokens_fn(catalog_triples, vocab_size: int, prompt_length: int):
    """A `prefix_allowed_tokens_fn` for generate on a batch padded to
    `prompt_length`: the generated part `input_ids[prompt_length:]` is the
    prefix looked up in the catalog trie. None (no catalog) -> None."""
    if catalog_triples is None:
        return None
    trie = build_trie(catalog_triples)

    def fn(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        prefix = tuple(int(t) for t in input_ids[prompt_length:].tolist())
        allowed = trie.get(prefix)
        if not allowed:
            # Only reachable for a -1e9 / -inf placeholder beam; it cannot be returned while enough valid
            # candidates exist (asserted by the caller). Keep generate() from raising.
            return list(range(vocab_size))
        return allowed

    return fn


def _left_padded(prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, L], attention_mask [B, L]) left-padded with PAD."""
    rows = [list(p) if not torch.is_tensor(p) else p.tolist() for p in prompts]
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {i} is empty")
        ids[i, longest - len(r):] = torch.as_tensor(r, dtype=torch.long)
        mask[i, longest - len(r):] = 1
    return ids, mask


@torch.no_grad()
def hf_causal_beam_search(model, prompts, *, beam_width: int, num_return_sequences: int | None = None,
                          catalog_triples=None, rounds: int = 3) -> list[list[tuple[tuple[int, ...], float]]]:
    """Beam search with `model.generate` on a LEFT-padded batch of prompts
    (token-id lists) of different lengths, with an attention mask.

    Returns per prompt the N (= num_return_sequences, default W, <= W)
    results (generated tokens, sequences_scores), best first. Asserts that
    every sequence has exactly `rounds` new tokens, that each
    sequences_score equals the sum of that beam's per-step log-probs, that no
    -1e9 placeholder beam is returned (fewer than N valid triples), and that
    the RoPE positions generate used are 0..len_b-1 for prompt b and len_b,
    len_b+1, ... for its generated tokens (pads: 0).
    """
    w = int(beam_width)
    n = w if num_return_sequences is None else int(num_return_sequences)
    if not 1 <= n <= w:
        raise ValueError(f"generate needs 1 <= num_return_sequences <= num_beams, got N={n}, W={w}")
    ids, mask = _left_padded(prompts)
    batch, prompt_length = ids.shape
    lengths = mask.sum(dim=1)                                           # [B]

    positions: list[torch.Tensor] = []

    def capture(module, args, kwargs):
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        positions.append(pos.detach().clone())

    handle = model.model.rotary_emb.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        out = model.generate(
            input_ids=ids, attention_mask=mask, num_beams=w, num_return_sequences=n, max_new_tokens=rounds,
            do_sample=False, length_penalty=0.0, early_stopping="never", eos_token_id=None, output_scores=True,
            return_dict_in_generate=True,
            prefix_allowed_tokens_fn=causal_prefix_allowed_tokens_fn(catalog_triples, model.config.vocab_size,
                                                                     prompt_length),
        )
    finally:
        handle.remove()

    # positions: prefill [B*W, L] (beams are expanded before the prefill), then [B*W, 1] per step
    assert len(positions) == rounds, len(positions)
    want_prefill = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0).repeat_interleave(w, dim=0)
    assert torch.equal(positions[0].reshape(batch * w, prompt_length), want_prefill), positions[0]
    for step in range(1, rounds):
        want = (lengths - 1 + step).repeat_interleave(w).reshape(batch * w, 1)
        assert torch.equal(positions[step].reshape(batch * w, 1), want), (step, positions[step])

    seqs, scores = out.sequences, out.sequences_scores
    assert seqs.shape == (batch * n, prompt_length + rounds), seqs.shape
    assert torch.equal(seqs[:, :prompt_length], ids.repeat_interleave(n, dim=0))
    # sequences_scores (length_penalty 0) == sum of the beam's per-step log-probs
    transition = model.compute_transition_scores(seqs, out.scores, out.beam_indices, normalize_logits=False)
    assert transition.shape == (batch * n, rounds), transition.shape
    sums = transition.sum(dim=-1)
    assert torch.allclose(sums, scores, atol=1e-5, rtol=1e-6), (sums, scores)
    # HF seeds beams 1..W-1 with -1e9 (and keeps -inf beams when a round has fewer than W valid candidates);
    # such placeholders never beat a valid beam, but are returned when fewer than N valid triples exist.
    assert bool((scores > -1e8).all()), f"fewer than N valid results; HF returned placeholders: {scores}"
    results = []
    for b in range(batch):
        rows = []
        for i in range(b * n, (b + 1) * n):
            rows.append((tuple(int(t) for t in seqs[i, prompt_length:].tolist()), float(scores[i])))
        results.append(rows)
    return results
