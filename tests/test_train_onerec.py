"""The encoder-decoder family of `xrec train` trains every target of a window in one pass
(`seq2seq_windows`, `seq2seq_inputs`): checked against the same Hugging Face T5 run one
target at a time, each prompt encoded alone, and xrec's causal encoder (the serving side)
against Hugging Face T5's encoder under a causal mask. The trained directory serving what
was trained is tests/test_train.py::test_trained_directory_serves_what_was_trained."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from xrec.config import ModelConfig
from xrec.model.attention import padding_mask
from xrec.model.loader import load_model
from xrec.realdata.sequences import IGNORE, seq2seq_windows
from xrec.realdata.train.models import TrainableModel, model_config, seq2seq_inputs

pytest.importorskip("transformers")

VOCAB, BOS = 48, 1


@pytest.fixture(scope="module")
def model():
    """A small causal-encoder OneRec in training form, its bias tables made non-trivial."""
    trainable = TrainableModel.create(model_config("onerec", VOCAB, 32, 2, 4, 64, BOS), seed=3)
    with torch.no_grad():
        for stack in (trainable.hf.encoder, trainable.hf.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1.0)
    return trainable


def _window(rng, num_items: int) -> np.ndarray:
    return np.concatenate(([BOS], rng.integers(2, VOCAB, 3 * num_items)))


def _causal(length: int) -> torch.Tensor:
    """The additive causal mask of HF T5's encoder, written out: `[1, 1, L, L]`."""
    upper = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    return torch.zeros(length, length).masked_fill(upper, torch.finfo(torch.float32).min)[None, None]


def _target_loss(hf, prompt: np.ndarray, target: np.ndarray) -> torch.Tensor:
    """Summed cross-entropy of one target's 3 tokens, its prompt encoded alone."""
    ids = torch.as_tensor(prompt)[None]
    encoded = hf.encoder(input_ids=ids, attention_mask=_causal(len(prompt)))
    decoder = torch.as_tensor([BOS, *target[:2]])[None]
    logits = hf(encoder_outputs=encoded, decoder_input_ids=decoder, use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits, torch.as_tensor(target), reduction="sum")


def test_windows_make_every_item_but_the_first_a_target_once():
    vocab = SimpleNamespace(bos_id=BOS, item_tokens=np.arange(30).reshape(10, 3) + 10)
    windows = seq2seq_windows(vocab, [np.arange(7), np.array([7]), np.array([8, 9])], max_items=3)
    items = [((w[1:] - 10) // 3).reshape(-1, 3)[:, 0].tolist() for w in windows]
    assert items == [[3, 4, 5, 6], [0, 1, 2, 3], [8, 9]]     # aligned to the end, one shared
    assert all(w[0] == BOS for w in windows)
    targets = [i for w in items for i in w[1:]]
    assert sorted(targets) == [1, 2, 3, 4, 5, 6, 9]            # every item but a user's first


def test_one_pass_loss_is_the_mean_of_the_targets_trained_alone(model):
    """The oracle: one pass over a padded batch of windows gives the loss (and gradient) of
    every target run separately through T5, its prompt alone, the decoder 3 tokens long."""
    rng = np.random.default_rng(0)
    windows = [_window(rng, n) for n in (5, 2, 4)]
    loss, count = model.loss(windows)
    separate = [_target_loss(model.hf, w[:1 + 3 * k], w[1 + 3 * k:4 + 3 * k])
                for w in windows for k in range(1, len(w) // 3)]
    assert count == 3 * len(separate) == 3 * (4 + 1 + 3)
    expected = torch.stack(separate).sum() / count
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    params = [p for p in model.hf.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    want = torch.autograd.grad(expected, params, allow_unused=True)
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_one_pass_inputs_by_hand():
    """Two windows of 3 and 2 items (start 1): the encoder reads all but the last item, block
    k sees encoder positions 0 .. 3k, itself causally, and nothing of another block."""
    windows = [np.array([1, 10, 11, 12, 20, 21, 22, 30, 31, 32]), np.array([1, 40, 41, 42, 50, 51, 52])]
    inputs = seq2seq_inputs(windows, start_id=1)
    assert inputs["input_ids"].tolist() == [[1, 10, 11, 12, 20, 21, 22], [1, 40, 41, 42, 0, 0, 0]]
    assert inputs["decoder_input_ids"].tolist() == [[1, 20, 21, 1, 30, 31], [1, 50, 51, 0, 0, 0]]
    assert inputs["labels"].tolist() == [[20, 21, 22, 30, 31, 32], [50, 51, 52] + [IGNORE] * 3]
    cross = inputs["attention_mask"][0, 0] == 0
    assert cross.sum(1).tolist() == [4, 4, 4, 7, 7, 7]
    assert cross[:3, :4].all() and cross[3:].all()
    self_ = inputs["decoder_attention_mask"][0, 0] == 0
    assert self_.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                    [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert torch.equal(inputs["encoder_mask"][0, 0] == 0, torch.ones(7, 7, dtype=torch.bool).tril())


def test_xrec_causal_encoder_is_hf_t5_under_a_causal_mask(model, tmp_path):
    """Serving side: xrec's encoder with `is_encoder_causal`, over a right-padded batch, gives
    HF T5's encoder output under the causal mask, and a prompt's first n positions encode as
    those n positions alone."""
    model.save(tmp_path)
    xrec = load_model(tmp_path, dtype=torch.float32)
    assert xrec.config.is_encoder_causal
    rng = np.random.default_rng(1)
    prompts = [_window(rng, n) for n in (6, 3)]
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(2, 19, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = torch.as_tensor(p)
    with torch.no_grad():
        got = xrec.encode(xrec.embed(ids), padding_mask(lengths, 19))
        for row, p in enumerate(prompts):
            want = model.hf.encoder(input_ids=torch.as_tensor(p)[None],
                                    attention_mask=_causal(len(p))).last_hidden_state[0]
            torch.testing.assert_close(got[row, :len(p)], want, rtol=1e-4, atol=1e-5)
            prefix = xrec.encode(xrec.embed(torch.as_tensor(p[:7])[None]), None)[0]
            torch.testing.assert_close(prefix, got[row, :7], rtol=1e-4, atol=1e-5)
        bidirectional = model.hf.encoder(input_ids=torch.as_tensor(prompts[1])[None]).last_hidden_state[0]
        assert float((bidirectional - got[1, :10]).abs().max()) > 1e-2   # the mask matters


def test_causal_encoder_without_a_bias_table():
    """Absolute mode has no bias table: the causal mask alone, and position j ignores j+1 on."""
    from xrec.model.onerec import OneRecModel
    config = ModelConfig(d_model=16, d_ff=24, num_encoder_layers=2, num_decoder_layers=1, num_heads=2,
                         head_dim=8, num_kv_heads=2, vocab_size=40, use_absolute_position_embedding=True,
                         is_encoder_causal=True, torch_dtype="float32")
    torch.manual_seed(0)
    model = OneRecModel(config).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ids = torch.randint(0, 40, (1, 9))
    with torch.no_grad():
        full = model.encode(model.embed(ids), None)
        changed = ids.clone()
        changed[0, 5:] = (changed[0, 5:] + 1) % 40
        other = model.encode(model.embed(changed), None)
        bidirectional = OneRecModel(config.replace(is_encoder_causal=False)).eval()
        bidirectional.load_state_dict(model.state_dict())
        assert float((bidirectional.encode(bidirectional.embed(ids), None) - full).abs().max()) > 1e-3
    torch.testing.assert_close(full[0, :5], other[0, :5])
    assert float((full[0, 5:] - other[0, 5:]).abs().max()) > 1e-3


def test_config_key_round_trips():
    config = ModelConfig(is_encoder_causal=True)
    assert config.to_dict()["is_encoder_causal"] is True
    assert ModelConfig.from_dict(config.to_dict()).is_encoder_causal
    assert not ModelConfig.from_dict({"model_type": "onerec"}).is_encoder_causal
    with pytest.raises(ValueError, match="is_encoder_causal"):
        ModelConfig.from_dict({"model_type": "onerec", "is_encoder_causal": "yes"})


def test_export_to_hf_t5_refuses_a_causal_encoder(model, tmp_path):
    from xrec.realdata.train.hf_models import export_hf_t5
    model.save(tmp_path)
    with pytest.raises(ValueError, match="causal encoder"):
        export_hf_t5(load_model(tmp_path, dtype=torch.float32))


def test_family_defaults():
    """epochs, batch size, learning rate and look-ahead left unset take the family's; the
    decoder-only defaults are those ML-1M was measured with."""
    from xrec.realdata.train.options import TrainOptions
    qwen3, onerec = TrainOptions(), TrainOptions(family="onerec")
    assert (qwen3.epochs, qwen3.batch_size, qwen3.lr, qwen3.lookahead) == (12, 32, 3e-3, 0.5)
    assert (onerec.epochs, onerec.batch_size, onerec.lr, onerec.lookahead) == (5, 8, 5e-4, 0.0)
    onerec.check()
    assert TrainOptions(family="onerec", lr=2e-3, epochs=3).lr == 2e-3
    with pytest.raises(ValueError, match="family: got 't5'"):
        TrainOptions(family="t5").check()
