"""Hugging Face `transformers` T5 as an oracle for the OneRec network and its
beam search. Test helper: `transformers` is imported lazily inside the
functions (tests should `pytest.importorskip("transformers")` first).

Facts about transformers 5.24 these helpers rely on (checked in
tests/test_oracles.py):

* `T5Config` ALWAYS ties `lm_head` to `shared` (it forces
  `config.tie_word_embeddings = True`); passing `tie_word_embeddings=False`
  only turns off the `d_model**-0.5` scaling of the decoder output
  (`config.scale_decoder_outputs = False`), and `save_pretrained` then writes
  `"tie_word_embeddings": true, "scale_decoder_outputs": false` and no
  `lm_head.weight`. `make_hf_t5(tie_word_embeddings=False)` therefore unties
  the in-memory model by hand (a separate random `lm_head`) and rewrites the
  saved directory so that it says `"tie_word_embeddings": false` and holds
  `lm_head.weight`: a genuinely untied OneRec checkpoint.
* A default T5 has `eos_token_id=1` in its generation config: a beam that
  picks token 1 ends there (score = sum of its shorter log-probs, no length
  penalty) and, since `pad_token_id` 0 is falsy in generate's
  `pad_token_id or eos_token_id[0]`, the finished sequence comes back padded
  with 1s, e.g. `[0, 1, 1, 1]`, indistinguishable from a real triple.
  `make_hf_t5` sets eos_token_id None in `model.config` and
  `model.generation_config`, and `hf_beam_search` also passes
  `eos_token_id=None` to `generate` (an explicit None kwarg does override the
  generation config), so no beam can end before `max_new_tokens`.
* Beam search applies `prefix_allowed_tokens_fn` to the log-softmax over the
  whole vocabulary (xrec's `normalize="full"`), and with
  `length_penalty=0.0` a sequence's `sequences_scores` is the plain sum of its
  per-step log-probabilities (asserted in `hf_beam_search`).
* `num_return_sequences` must be <= `num_beams` in `generate`.
* `generate` with its cache fails (IndexError in `cache_utils`) when the decoder
  has more layers than the encoder: T5 sizes both caches by `num_layers`.
  `hf_beam_search` turns the cache off then (the decoder recomputes its few
  positions each round).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import torch

__all__ = ["make_hf_t5", "hf_beam_search", "hf_encoder_and_logits", "build_trie", "prefix_allowed_tokens_fn",
           "xrec_config"]

DECODER_START = 0


def make_hf_t5(tmp_dir, *, seed: int, vocab_size: int = 64, d_model: int = 32, d_kv: int = 8, d_ff: int = 64,
               num_layers: int = 2, num_decoder_layers: int = 2, num_heads: int = 4, relative_bias: bool = True,
               tie_word_embeddings: bool = True, scale_decoder_outputs: bool = True,
               relative_attention_num_buckets: int = 32,
               relative_attention_max_distance: int = 32, std: float = 0.25, embedding_std: float = 2.0,
               bias_std: float = 2.0):
    """A random gated-SiLU `T5ForConditionalGeneration` (eval, float32, eager
    attention), deterministic from `seed`, saved with safetensors in `tmp_dir`.

    Weights: linear ~ N(0, std); shared ~ N(0, embedding_std) and, when
    untied, lm_head ~ N(0, embedding_std / sqrt(d_model)) (it is not scaled by
    d_model**-0.5), so logits are well spread (the top token of a round has
    a log-prob around -0.8); relative bias tables ~ N(0, bias_std) so they
    matter; RMSNorm weights ~ 1 + N(0, 0.2). With these sizes float32 Hugging
    Face logits agree with a float64 recompute to ~1e-5 (std 0.5 gives ~2e-4:
    too loose for 1e-4 score checks).
    `relative_bias=False`: both bias tables are zeroed and config.json says
    `"use_absolute_position_embedding": true`. `scale_decoder_outputs=False` (tied head
    only): the head's input is not scaled by d_model**-0.5 and config.json says
    `"scale_decoder_outputs": false`, as transformers 5 saves `T5Config(tie_word_embeddings=False)`.
    Generation never stops early: eos_token_id is None in config and
    generation config; decoder_start_token_id = pad_token_id = 0.

    Returns (model, directory).
    """
    from transformers import T5Config, T5ForConditionalGeneration

    directory = Path(tmp_dir)
    directory.mkdir(parents=True, exist_ok=True)
    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=num_layers,
        num_decoder_layers=num_decoder_layers, num_heads=num_heads,
        relative_attention_num_buckets=relative_attention_num_buckets,
        relative_attention_max_distance=relative_attention_max_distance,
        feed_forward_proj="gated-silu", dropout_rate=0.0, layer_norm_epsilon=1e-6,
        decoder_start_token_id=DECODER_START, pad_token_id=0, eos_token_id=None,
        tie_word_embeddings=tie_word_embeddings,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)  # the constructor's own init; every weight is overwritten below anyway
    model = T5ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        if not tie_word_embeddings:
            model.lm_head.weight = torch.nn.Parameter(torch.empty(vocab_size, d_model))
        seen = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name.endswith("layer_norm.weight"):
                value = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
            elif name.endswith("relative_attention_bias.weight"):
                value = bias_std * torch.randn(p.shape, generator=gen)
                if not relative_bias:
                    value = torch.zeros(p.shape)
            elif name == "lm_head.weight":
                value = embedding_std * d_model ** -0.5 * torch.randn(p.shape, generator=gen)
            elif name in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
                value = embedding_std * torch.randn(p.shape, generator=gen)
            else:
                value = std * torch.randn(p.shape, generator=gen)
            p.copy_(value.to(p.dtype))
    model = model.float().eval()
    # EOS off where generate() looks for it; decoder start and pad = 0.
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = None
        cfg.decoder_start_token_id = DECODER_START
        cfg.pad_token_id = 0
        cfg.bos_token_id = None
    if tie_word_embeddings:
        assert model.lm_head.weight is model.shared.weight
        assert model.config.scale_decoder_outputs
        model.config.scale_decoder_outputs = scale_decoder_outputs   # read at every forward
    else:
        assert scale_decoder_outputs, "an untied head is never scaled (see the module docstring)"
        assert model.lm_head.weight is not model.shared.weight
        assert not model.config.scale_decoder_outputs

    model.save_pretrained(str(directory), safe_serialization=True)
    raw = json.loads((directory / "config.json").read_text())
    raw["decoder_start_token_id"] = DECODER_START
    raw["eos_token_id"] = None
    raw["tie_word_embeddings"] = bool(tie_word_embeddings)
    raw["use_absolute_position_embedding"] = not relative_bias
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    if not tie_word_embeddings:
        # save_pretrained treats lm_head as tied to shared (T5Config forces the tie) and drops it.
        from safetensors.torch import load_file, save_file

        files = sorted(directory.glob("*.safetensors"))
        assert len(files) == 1, files
        tensors = load_file(str(files[0]))
        tensors["lm_head.weight"] = model.lm_head.weight.detach().clone().contiguous()
        save_file(tensors, str(files[0]), metadata={"format": "pt"})
    return model, directory


def xrec_config(directory):
    """The xrec ModelConfig the saved directory describes (t5 dialect)."""
    from xrec.config import ModelConfig

    return ModelConfig.from_file(Path(directory) / "config.json")


# ---------------------------------------------------------------------------
# constraint trie
# ---------------------------------------------------------------------------

def build_trie(catalog_triples: Iterable[Sequence[int]]) -> dict[tuple[int, ...], list[int]]:
    """prefix tuple -> sorted list of allowed next tokens."""
    trie: dict[tuple[int, ...], set[int]] = {}
    for triple in catalog_triples:
        triple = tuple(int(t) for t in triple)
        for r in range(len(triple)):
            trie.setdefault(triple[:r], set()).add(triple[r])
    return {k: sorted(v) for k, v in trie.items()}


def prefix_allowed_tokens_fn(catalog_triples: Iterable[Sequence[int]] | None, vocab_size: int):
    """A `prefix_allowed_tokens_fn` for generate: the decoder sequence's first
    token is the decoder start, the rest is the prefix looked up in the trie.
    None (no catalog) -> None."""
    if catalog_triples is None:
        return None
    trie = build_trie(catalog_triples)

    def fn(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        prefix = tuple(int(t) for t in input_ids[1:].tolist())
        allowed = trie.get(prefix)
        if not allowed:
            # Only reachable for a placeholder beam HF keeps at -1e9; it can never be returned
            # while enough valid candidates exist. Keep generate() from raising.
            return list(range(vocab_size))
        return allowed

    return fn


# ---------------------------------------------------------------------------
# search and forward
# ---------------------------------------------------------------------------

def _is_embeds(request) -> bool:
    return torch.is_tensor(request) and request.is_floating_point()


def _batch(requests, d_model: int):
    """Right-padded batch: (input_ids or None, inputs_embeds or None, attention_mask)."""
    kinds = {_is_embeds(r) for r in requests}
    if len(kinds) != 1:
        raise ValueError("requests must be all token-id lists or all [L, D] embedding tensors")
    lengths = [len(r) for r in requests]
    longest = max(lengths)
    mask = torch.zeros(len(requests), longest, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    if kinds == {True}:
        embeds = torch.zeros(len(requests), longest, d_model, dtype=torch.float32)
        for i, r in enumerate(requests):
            embeds[i, : len(r)] = r.to(torch.float32)
        return None, embeds, mask
    ids = torch.zeros(len(requests), longest, dtype=torch.long)
    for i, r in enumerate(requests):
        ids[i, : len(r)] = torch.as_tensor(list(r) if not torch.is_tensor(r) else r, dtype=torch.long)
    return ids, None, mask


@torch.no_grad()
def hf_beam_search(model, requests, *, beam_width: int, num_return_sequences: int | None = None,
                   catalog_triples=None, rounds: int = 3) -> list[list[tuple[tuple[int, ...], float]]]:
    """Beam search with `model.generate` on a batch of requests of different
    lengths (token-id lists, or float [L, D] tensors fed as inputs_embeds),
    right-padded with an attention mask.

    Returns per request the N (= num_return_sequences, default W, <= W)
    results (tokens without the decoder start token, sequences_scores), best
    first. Asserts that every sequence has exactly `rounds` tokens, that no
    -1e9 placeholder beam is returned (fewer than N valid triples), and that
    each sequences_score equals the sum of that beam's per-step log-probs.
    """
    w = int(beam_width)
    n = w if num_return_sequences is None else int(num_return_sequences)
    if n > w:
        raise ValueError(f"generate needs num_return_sequences <= num_beams, got N={n}, W={w}")
    ids, embeds, mask = _batch(requests, model.config.d_model)
    kwargs = dict(attention_mask=mask)
    if ids is not None:
        kwargs["input_ids"] = ids
    else:
        kwargs["inputs_embeds"] = embeds
    out = model.generate(
        **kwargs, use_cache=model.config.num_decoder_layers <= model.config.num_layers,
        num_beams=w, num_return_sequences=n, max_new_tokens=rounds,
        do_sample=False, length_penalty=0.0, early_stopping="never", eos_token_id=None, output_scores=True,
        return_dict_in_generate=True,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn(catalog_triples, model.config.vocab_size),
    )
    seqs, scores = out.sequences, out.sequences_scores
    assert seqs.shape == (len(requests) * n, rounds + 1), seqs.shape
    assert bool((seqs[:, 0] == model.generation_config.decoder_start_token_id).all())
    # sequences_scores (length_penalty 0) == sum of the beam's per-step log-probs
    transition = model.compute_transition_scores(seqs, out.scores, out.beam_indices, normalize_logits=False)
    assert transition.shape == (len(requests) * n, rounds), transition.shape
    sums = transition.sum(dim=-1)
    assert torch.allclose(sums, scores, atol=1e-5, rtol=1e-6), (sums, scores)
    # HF seeds beams 1..W-1 with score -1e9 (and fills with -inf when a round has fewer than W valid
    # candidates); such placeholders never beat a valid beam, but if fewer than N valid triples exist
    # they are returned instead of fewer results, and the comparison is meaningless.
    assert bool((scores > -1e8).all()), f"fewer than N valid results; HF returned placeholders: {scores}"
    results = []
    for b in range(len(requests)):
        rows = []
        for i in range(b * n, (b + 1) * n):
            rows.append((tuple(int(t) for t in seqs[i, 1:].tolist()), float(scores[i])))
        results.append(rows)
    return results


@torch.no_grad()
def hf_encoder_and_logits(model, inputs, decoder_input_ids=None, *, decoder_inputs_embeds=None):
    """One unbatched request: (encoder output [L, D], decoder logits [T, V]).

    `inputs`: token ids (list / 1-D LongTensor) or a float [L, D] tensor
    (inputs_embeds). The decoder input is `decoder_input_ids` [T] (include the
    decoder start token yourself) or `decoder_inputs_embeds` [T, D].
    """
    kwargs = {}
    if _is_embeds(inputs):
        kwargs["inputs_embeds"] = inputs.to(torch.float32)[None]
    else:
        kwargs["input_ids"] = torch.as_tensor(list(inputs) if not torch.is_tensor(inputs) else inputs,
                                              dtype=torch.long)[None]
    if (decoder_input_ids is None) == (decoder_inputs_embeds is None):
        raise ValueError("give exactly one of decoder_input_ids and decoder_inputs_embeds")
    if decoder_input_ids is not None:
        kwargs["decoder_input_ids"] = torch.as_tensor(decoder_input_ids, dtype=torch.long).reshape(1, -1)
    else:
        kwargs["decoder_inputs_embeds"] = decoder_inputs_embeds.to(torch.float32)[None]
    out = model(**kwargs, use_cache=False, return_dict=True)
    return out.encoder_last_hidden_state[0], out.logits[0]
