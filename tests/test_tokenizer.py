"""PromptTokenizer (tokenizers + jinja2), SidLayout and the offline OpenOneRec-layout tokenizer."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from xrec.errors import InvalidArgument
from xrec.catalog.sid_vocab import (QWEN3_SPECIAL_TOKENS, SidLayout, build_sid_tokenizer,
                            random_sid_catalog, write_sid_tokenizer)
from xrec.tokenizer import PromptTokenizer

SMALL = SidLayout(num_base_tokens=512, codebook_size=16)
MESSAGES = [
    {"role": "system", "content": "You are a recommender. Answer with semantic IDs."},
    {"role": "user", "content": "I watched <s_a_1><s_b_2><s_c_3> twice and <s_a_15><s_b_0><s_c_9>"
                                "; Café naïve 推荐 12345\n\n  what next?"},
    {"role": "assistant", "content": "<|sid_begin|><s_a_4><s_b_5><s_c_6><|sid_end|>"},
    {"role": "user", "content": "More like that, please!"},
]
PROMPTS = ["", "Hello world", "  leading spaces\tand\ttabs\r\n", "<s_a_0><s_b_15><s_c_7>",
           "user watched<s_a_3> then<|sid_begin|>", "don't 'll numbers 3.14159 and émoji 🙂",
           "<|im_start|>user\nhi<|im_end|>\n", "<xrec_unused_600> <s_a_99> <s_d_1>"]


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sid-small")
    write_sid_tokenizer(out, SMALL)
    return out


@pytest.fixture(scope="module")
def small(small_dir):
    return PromptTokenizer.from_model_dir(small_dir)


# --- SidLayout -----------------------------------------------------------------------------

def test_layout_of_openonerec():
    layout = SidLayout()
    assert (layout.num_base_tokens, layout.codebook_size, layout.num_levels) == (151_643, 8192, 3)
    assert (layout.first_special_id, layout.first_itemic_id) == (151_643, 151_669)
    assert [layout.level_start(level) for level in range(3)] == [151_669, 159_861, 168_053]
    assert (layout.sid_begin_id, layout.sid_end_id) == (176_245, 176_246)
    assert layout.num_tokens == 176_247
    assert layout.vocab_size == 176_384
    assert layout.itemic_token(0, 340) == "<s_a_340>"
    assert layout.itemic_token(2, 8191) == "<s_c_8191>"
    assert layout.itemic_id(1, 6566) == 159_861 + 6566
    assert len(QWEN3_SPECIAL_TOKENS) == 26 and len(set(QWEN3_SPECIAL_TOKENS)) == 26


def test_small_layout_and_bad_values():
    assert (SMALL.first_itemic_id, SMALL.sid_begin_id, SMALL.num_tokens, SMALL.vocab_size) == (
        538, 586, 588, 768)
    assert SidLayout(num_base_tokens=1024 - 26 - 2 - 48, codebook_size=16).vocab_size == 1024
    for kwargs in ({"num_base_tokens": 100}, {"codebook_size": 0}, {"num_levels": 27},
                   {"codebook_size": 2.0}, {"num_levels": True}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SidLayout(**kwargs)
    with pytest.raises(ValueError, match="code"):
        SMALL.itemic_token(0, 16)
    with pytest.raises(ValueError, match="level"):
        SMALL.level_start(3)


# --- the written tokenizer -----------------------------------------------------------------

def test_full_size_tokenizer_has_openonerec_ids(tmp_path):
    layout = SidLayout()
    write_sid_tokenizer(tmp_path, layout)
    tokenizer = PromptTokenizer.from_model_dir(tmp_path)
    expected = {"<|endoftext|>": 151_643, "<|im_start|>": 151_644, "<|im_end|>": 151_645,
                "<think>": 151_667, "</think>": 151_668, "<s_a_0>": 151_669, "<s_b_0>": 159_861,
                "<s_c_0>": 168_053, "<s_c_8191>": 176_244, "<|sid_begin|>": 176_245,
                "<|sid_end|>": 176_246}
    assert {token: tokenizer.token_to_id(token) for token in expected} == expected
    assert tokenizer.vocab_size == 176_247
    is_known = tokenizer.known_ids(np.arange(layout.vocab_size))
    assert is_known.shape == (176_384,)
    assert is_known[:176_247].all() and not is_known[176_247:].any()
    assert tokenizer.encode("<s_a_340><s_b_6566><s_c_5603>") == [151_669 + 340, 159_861 + 6566,
                                                                 168_053 + 5603]


def test_every_added_token_has_its_layout_id(small):
    for token_id, token in enumerate(SMALL.added_tokens(), start=SMALL.first_special_id):
        assert small.token_to_id(token) == token_id and small.id_to_token(token_id) == token
    assert small.vocab_size == SMALL.num_tokens
    assert small.known_ids(np.arange(SMALL.vocab_size)).sum() == SMALL.num_tokens
    # the regular tokens fill ids 0 .. 511 exactly
    assert all(small.id_to_token(i) is not None for i in range(512))


def test_build_is_deterministic():
    layout = SidLayout(num_base_tokens=2048, codebook_size=4)
    assert build_sid_tokenizer(layout).to_str() == build_sid_tokenizer(layout).to_str()
    # a bigger base vocabulary than the corpus trains: filler entries that no text reaches
    tokenizer = build_sid_tokenizer(layout)
    assert tokenizer.id_to_token(2047) == "<xrec_unused_2047>"
    assert 2047 not in tokenizer.encode("<xrec_unused_2047>").ids


def test_config_is_merged(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"item_catalog": "catalog.bin", "eos_token": "</s>", "custom": [1, 2]}))
    write_sid_tokenizer(tmp_path, SMALL)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["item_catalog"] == "catalog.bin" and config["custom"] == [1, 2]
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == (
        "<|im_end|>", "<|endoftext|>", None)
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and "chat_template" in config
    assert not (tmp_path / "generation_config.json").exists()


def test_matches_transformers(small_dir, small):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(small_dir)
    for prompt in PROMPTS + [m["content"] for m in MESSAGES]:
        assert small.encode(prompt) == reference(prompt)["input_ids"], prompt
    for messages in (MESSAGES, MESSAGES[1:2], MESSAGES[:2]):
        text = reference.apply_chat_template(messages, add_generation_prompt=True,
                                             enable_thinking=False, tokenize=False)
        assert small.render_chat(messages) == text
        ids = reference.apply_chat_template(messages, add_generation_prompt=True,
                                            enable_thinking=False, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert small.encode_chat(messages) == list(ids)
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_truncation_and_padding_of_tokenizer_json_are_off(tmp_path):
    """A tokenizer.json saved with truncation or padding on: Hugging Face's tokenizer call
    encodes the whole text unpadded; xrec cut prompts (and a chat's generation prompt) at the
    saved length and padded them, and a generation prefix, with pad tokens."""
    transformers = pytest.importorskip("transformers")
    tokenizer = build_sid_tokenizer(SMALL)
    tokenizer.enable_truncation(max_length=4)
    tokenizer.enable_padding(length=8, pad_id=SMALL.first_special_id, pad_token="<|endoftext|>")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    write_sid_tokenizer(tmp_path / "plain", SMALL)   # the same tokenizer, saved without either
    (tmp_path / "tokenizer_config.json").write_text(
        (tmp_path / "plain" / "tokenizer_config.json").read_text())
    ours = PromptTokenizer.from_model_dir(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for prompt in PROMPTS + [m["content"] for m in MESSAGES]:
        assert ours.encode(prompt) == reference(prompt)["input_ids"], prompt
    assert ours.encode_chat(MESSAGES) == _chat_ids(reference, MESSAGES)
    # a generation prefix is its own tokens: no pad tokens after it
    assert ours.encode("<|sid_begin|>", add_special_tokens=False) == [SMALL.sid_begin_id]
    assert ours.max_token_chars == PromptTokenizer.from_model_dir(tmp_path / "plain").max_token_chars


def test_bpe_dropout_of_tokenizer_json_is_off(tmp_path):
    """A tokenizer.json saved with BPE dropout: transformers' Qwen2Tokenizer builds its BPE
    without it; xrec skipped merges at random, a different split of a prompt each time (at
    dropout 1.0, always: every byte its own token)."""
    transformers = pytest.importorskip("transformers")
    write_sid_tokenizer(tmp_path, SMALL)
    tokenizer = build_sid_tokenizer(SMALL)
    tokenizer.model.dropout = 1.0
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ours = PromptTokenizer.from_model_dir(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for prompt in PROMPTS + [m["content"] for m in MESSAGES]:
        assert ours.encode(prompt) == reference(prompt)["input_ids"], prompt
    assert ours.encode_chat(MESSAGES) == _chat_ids(reference, MESSAGES)


def test_min_num_tokens_counts_an_added_token_normalized(tmp_path):
    """An added token stands for its content normalized: under NFKC "\ufdfa" is 18 characters.
    The bound took the longest token string (20 characters here) as the most one token
    covers, so 50 such tokens (1,800 normalized characters) were said to need 90."""
    from tokenizers import AddedToken, normalizers

    tokenizer = build_sid_tokenizer(SMALL)
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.add_tokens([AddedToken("\ufdfa\ufdfa", normalized=True)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ours = PromptTokenizer.from_model_dir(tmp_path)
    text = "\ufdfa" * 100
    assert ours.encode(text) == [SMALL.num_tokens] * 50
    assert ours.min_num_tokens(text) <= 50


def _both_tokenizers(tmp_path, **config_changes):
    """xrec's and Hugging Face's tokenizer of a sid tokenizer whose tokenizer_config.json
    has `config_changes` (a chat template, a flag) applied: the oracle and the code under test
    read the same files."""
    transformers = pytest.importorskip("transformers")
    write_sid_tokenizer(tmp_path, SMALL)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **config_changes}))
    return (PromptTokenizer.from_model_dir(tmp_path),
            transformers.AutoTokenizer.from_pretrained(tmp_path))


def _chat_ids(reference, messages) -> list[int]:
    """The ids of Hugging Face's `apply_chat_template` (a list, or a mapping's input_ids)."""
    ids = reference.apply_chat_template(messages, add_generation_prompt=True,
                                        enable_thinking=False, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_template_sees_the_special_tokens_as_transformers_does(tmp_path):
    """`bos_token: null` rendered as "None" in a template that writes `{{ bos_token }}`, and
    `pad_token` (any named special token but bos / eos) was undefined: Hugging Face passes
    the named special tokens that are set, and leaves a null one undefined."""
    transformers = pytest.importorskip("transformers")
    write_sid_tokenizer(tmp_path, SMALL)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] is None and config["pad_token"] == "<|endoftext|>"
    config["tokenizer_class"] = "PreTrainedTokenizerFast"   # no class defaults of its own
    config["chat_template"] = ("{{ bos_token }}[{{ pad_token }}|{{ unk_token }}|{{ eos_token }}]"
                               "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                               "{{ eos_token }}\n{% endfor %}<|im_start|>assistant\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = PromptTokenizer.from_model_dir(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                         enable_thinking=False, tokenize=False)
    assert text.startswith("[<|endoftext|>||<|im_end|>]<|im_start|>system\n")
    assert ours.render_chat(MESSAGES) == text
    assert ours.encode_chat(MESSAGES) == _chat_ids(reference, MESSAGES)



def test_the_written_sid_tokenizer_shows_templates_the_special_tokens_transformers_does(tmp_path):
    """`write_sid_tokenizer` left `unk_token` out of tokenizer_config.json, so transformers'
    Qwen2Tokenizer gave a template its class default `<|endoftext|>` and xrec nothing."""
    template = ("[{{ bos_token }}|{{ unk_token }}|{{ pad_token }}|{{ eos_token }}]"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    ours, reference = _both_tokenizers(tmp_path, chat_template=template)
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                         enable_thinking=False, tokenize=False)
    assert ours.render_chat(MESSAGES) == text

def test_template_sees_the_special_tokens_of_special_tokens_map_json(tmp_path):
    """A directory saved by transformers 4.33 or older names its special tokens in
    special_tokens_map.json, its tokenizer_config.json without "added_tokens_decoder";
    transformers reads the map (over the config), xrec did not: `{{ bos_token }}` wrote
    nothing. A config with "added_tokens_decoder" is read alone, by both."""
    transformers = pytest.importorskip("transformers")
    _both_tokenizers(tmp_path, unk_token=None, chat_template=(
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{{ eos_token }}\n{% endfor %}<|im_start|>assistant\n"))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                       "rstrip": False, "single_word": False}, "eos_token": "<|endoftext|>"}))
    ours = PromptTokenizer.from_model_dir(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|endoftext|><|im_start|>system\n") and "<|im_end|>" not in text
    assert ours.render_chat(MESSAGES) == text
    assert ours.encode_chat(MESSAGES) == _chat_ids(reference, MESSAGES)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(SMALL.first_special_id + i): {
        "content": token, "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": True} for i, token in enumerate(QWEN3_SPECIAL_TOKENS)}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "<|im_end|>" in text
    assert PromptTokenizer.from_model_dir(tmp_path).render_chat(MESSAGES) == text


def test_template_with_generation_blocks(tmp_path):
    """`{% generation %}` (Hugging Face's assistant-mask block, in templates written for
    training) made the directory fail to load: "unknown tag 'generation'"."""
    ours, reference = _both_tokenizers(tmp_path, chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
        "{% generation %}{% set n = m.content|length %}{{ m.content }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                         enable_thinking=False, tokenize=False)
    assert "<|im_start|>assistant\n<|sid_begin|><s_a_4>" in text
    assert ours.render_chat(MESSAGES) == text
    assert ours.encode_chat(MESSAGES) == _chat_ids(reference, MESSAGES)


def test_template_tojson_takes_transformers_arguments(tmp_path):
    """transformers' `tojson` takes `ensure_ascii` (first, then indent, separators,
    sort_keys): `tojson(ensure_ascii=False)` refused every chat, `tojson(2)` indented."""
    ours, reference = _both_tokenizers(tmp_path, chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|tojson(ensure_ascii=False) }}"
        "|{{ m|tojson(true, 1, sort_keys=true) }}|{{ m.content|tojson(separators=(',', ':')) }}"
        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"))
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                         enable_thinking=False, tokenize=False)
    assert '; Café naïve 推荐' in text and "Caf\\u00e9" in text    # ensure_ascii false, then true
    assert ours.render_chat(MESSAGES) == text


def test_null_message_keys_are_undefined_in_the_template(tmp_path):
    """OpenAI clients send `"name": null` and the like; transformers leaves such keys out of
    the message (undefined in the template), xrec passed None ("[None]" below)."""
    ours, reference = _both_tokenizers(tmp_path, chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name is defined %}"
        "[{{ m.name }}]{% endif %}{% if 'tool_calls' in m %}(tools){% endif %}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"))
    messages = [{"role": "system", "content": "s", "name": None},
                {"role": "user", "content": "<s_a_1>", "name": "ann", "tool_calls": None},
                {"role": "assistant", "content": "ok", "tool_calls": [], "name": None}]
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>systems<|im_end|>\n<|im_start|>user[ann]<s_a_1>")
    assert ours.render_chat(messages) == text
    assert messages[0] == {"role": "system", "content": "s", "name": None}   # not changed


def test_template_sees_tools_and_documents_as_none(tmp_path):
    """transformers renders with `tools=None, documents=None` when none are given; xrec left
    them undefined, so `{% if tools is not none %}` (Mistral's, Llama 3.1's style) was true and
    wrote a tools header for an empty tool list into every chat."""
    ours, reference = _both_tokenizers(tmp_path, chat_template=(
        "{% if tools is not none %}[tools: {{ tools|length }}]{% endif %}"
        "{% if documents is none %}[no documents]{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"))
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("[no documents]<|im_start|>system\n")
    assert ours.render_chat(MESSAGES) == text
    assert ours.encode_chat(MESSAGES) == _chat_ids(reference, MESSAGES)


def test_reasoning_reaches_the_template_under_each_name(tmp_path):
    """transformers passes a message's reasoning (`reasoning_content`, `thinking` or
    `reasoning`, as OpenAI-style clients send it back) as `reasoning_content` and `thinking`:
    Qwen3's template writes it into the assistant turn's think block. xrec passed the keys as
    sent, so the reasoning of a message that named it `reasoning` was left out."""
    ours, reference = _both_tokenizers(tmp_path, chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{% if m.thinking is defined %}[{{ m.thinking }}]{% endif %}{{ m.content }}|"
        "{{ m|tojson }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"))
    messages = [{"role": "user", "content": "<s_a_1>"},
                {"role": "assistant", "content": "<s_a_2>", "reasoning": "liked <s_a_1>"},
                {"role": "user", "content": "more"},
                {"role": "assistant", "content": "x", "thinking": "t", "reasoning_content": "r",
                 "reasoning": None}]
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<think>liked <s_a_1></think>[liked <s_a_1>]<s_a_2>" in text
    assert ours.render_chat(messages) == text
    assert ours.encode_chat(messages) == _chat_ids(reference, messages)


def test_a_template_that_loops_over_content_parts_gets_them(tmp_path):
    """A template written for OpenAI content parts (`{% for part in message['content'] %}`,
    after `{% set loop_messages = messages %}`) is given them as they are, by transformers and
    vLLM; xrec joined their texts into one string, whose characters the loop then walked:
    the user's text was left out of the prompt."""
    ours, reference = _both_tokenizers(tmp_path, chat_template=(
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "<|im_start|>{{ message.role }}\n{% if message['content'] is string %}"
        "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"))
    messages = [{"role": "system", "content": "Recommend."},
                {"role": "user", "content": [{"type": "text", "text": "I liked <s_a_1>"},
                                             {"type": "text", "text": " and <s_a_2>"}]}]
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nI liked <s_a_1> and <s_a_2><|im_end|>" in text
    assert ours.render_chat(messages) == text
    assert ours.encode_chat(messages) == _chat_ids(reference, messages)


def test_split_special_tokens_of_tokenizer_config(tmp_path):
    """`"split_special_tokens": true` in tokenizer_config.json: transformers encodes the
    special tokens written in a prompt as text; xrec read them as the special tokens."""
    ours, reference = _both_tokenizers(tmp_path, split_special_tokens=True)
    assert SMALL.first_special_id + 1 not in reference("<|im_start|>user")["input_ids"]
    for prompt in PROMPTS + [m["content"] for m in MESSAGES]:
        assert ours.encode(prompt) == reference(prompt)["input_ids"], prompt
    assert ours.encode_chat(MESSAGES) == _chat_ids(reference, MESSAGES)


def test_chat_rendering(small):
    text = small.render_chat([{"role": "user", "content": "hi <s_a_1>"}])
    assert text == ("<|im_start|>user\nhi <s_a_1><|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = small.encode_chat([{"role": "user", "content": "hi <s_a_1>"}])
    assert ids[0] == small.token_to_id("<|im_start|>") and SMALL.itemic_id(0, 1) in ids
    parts = [{"role": "user",
              "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert small.render_chat(parts) == small.render_chat([{"role": "user", "content": "a\nb"}])


def test_tokens_text_and_lookups(small):
    ids = [SMALL.itemic_id(0, 3), SMALL.itemic_id(1, 15), SMALL.itemic_id(2, 0)]
    assert small.tokens_text(ids) == "<s_a_3><s_b_15><s_c_0>"
    assert small.tokens_text(np.array(ids)) == "<s_a_3><s_b_15><s_c_0>"
    assert small.token_to_id("<s_d_0>") is None and small.token_to_id(5) is None
    assert small.id_to_token(SMALL.num_tokens) is None and small.id_to_token(-1) is None
    # an id of a padded vocabulary without a token: no text (it raised, inside the batch)
    assert small.tokens_text([ids[0], 600]) is None


def test_request_errors(small):
    bad_messages = [None, [], "hi", [{"content": "x"}], [{"role": 1, "content": "x"}], ["hi"],
                    [{"role": "user"}], [{"role": "user", "content": 5}],
                    [{"role": "user", "content": []}],
                    [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]]
    for messages in bad_messages:
        with pytest.raises(InvalidArgument, match=r"^messages: "):
            small.render_chat(messages)
    with pytest.raises(InvalidArgument, match=r"^messages: the chat template refused them: "
                                              r"unsupported role \"tool\""):
        small.encode_chat([{"role": "tool", "content": "x"}])
    for prompt in (None, 5, ["a"], b"bytes"):
        with pytest.raises(InvalidArgument, match=r"^prompt: "):
            small.encode(prompt)
    # a lone surrogate (a Python string can hold one, JSON text cannot): the tokenizer raised
    # a TypeError ("TextInputSequence must be str")
    with pytest.raises(InvalidArgument, match=r"^prompt: character 6 is a lone surrogate"):
        small.encode("hello \ud800 world")
    with pytest.raises(InvalidArgument, match=r"^messages: character \d+ is a lone surrogate"):
        small.encode_chat([{"role": "user", "content": "hello \udfff"}])


def test_a_lone_surrogate_in_a_long_prompt_is_a_request_error(small):
    """A prompt long enough for the length bound (`check_prompt_bound`) met the normalizer
    first, which raised UnicodeEncodeError (no InvalidArgument, no code, no request id)."""
    from xrec.api_types import RecRequest, SearchLimits, validate

    limits = SearchLimits(vocab_size=SMALL.vocab_size, d_model=8, max_input_len=4,
                          max_beam_width=4, max_top_k=4, default_beam_width=4,
                          default_normalize="allowed", accepts_embeddings=False,
                          decoder_start_len=0)
    text = "a" * (4 * small.max_token_chars) + " \ud800"   # past the bound's quick check
    with pytest.raises(InvalidArgument, match=r"^prompt: character \d+ is a lone surrogate") \
            as error:
        validate(RecRequest(prompt=text, request_id="r1"), limits, small)
    assert error.value.request_id == "r1"
    with pytest.raises(InvalidArgument, match=r"^messages: character \d+ is a lone surrogate"):
        validate(RecRequest(messages=[{"role": "user", "content": text}]), limits, small)
    with pytest.raises(InvalidArgument, match=r"^messages: character \d+ is a lone surrogate"):
        small.min_num_tokens(text, "messages")


def test_a_lone_surrogate_in_the_generation_prefix_names_the_option(tmp_path):
    """`xrec recommend --generation-prefix` takes argv bytes that are not UTF-8 as lone
    surrogates; the engine refused them as "prompt: ..." (no prompt was given)."""
    from xrec import Engine
    from xrec.demo import write_random_model

    model_dir = write_random_model(tmp_path / "sid", "qwen3-sid-test", 0, 20)
    with pytest.raises(InvalidArgument, match=r"^option generation_prefix: character 1 is a "
                                              r"lone surrogate \('\\udcff'\)"):
        Engine.from_pretrained(model_dir, isolation="thread", device="cpu",
                               generation_prefix="<\udcff")


def test_template_sources(tmp_path):
    (tmp_path / "tokenizer.json").write_text(build_sid_tokenizer(SMALL).to_str())
    assert PromptTokenizer.from_model_dir(tmp_path / "nowhere") is None
    plain = PromptTokenizer.from_model_dir(tmp_path)
    assert not plain.has_chat_template
    with pytest.raises(InvalidArgument, match=r"^messages: this model has no chat template "
                                              r"\(xrec looks for .*chat_template.jinja"):
        plain.render_chat([{"role": "user", "content": "x"}])
    assert plain.encode("hi") == small_encode("hi")

    def configure(config, jinja=None):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
        if jinja is not None:
            (tmp_path / "chat_template.jinja").write_text(jinja)
        return PromptTokenizer.from_model_dir(tmp_path)

    variables = ("{{ bos_token }}|{{ eos_token }}|{{ messages[0]['content'] }}|"
                 "{{ add_generation_prompt }}|{{ enable_thinking }}|"
                 "{{ messages[0]['content']|tojson }}")
    user = [{"role": "user", "content": "é"}]
    named = configure({"chat_template": [{"name": "tool_use", "template": "T"},
                                         {"name": "default", "template": variables}],
                       "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"})
    assert named.render_chat(user) == '<s>|</s>|é|True|False|"é"'
    from_file = configure({"chat_template": "C"}, jinja="F{{ messages|length }}")
    assert from_file.render_chat(user) == "F1"  # chat_template.jinja first
    no_default = configure({"chat_template": [{"name": "tool_use", "template": "T"}]})
    with pytest.raises(InvalidArgument, match='no "default" template'):
        no_default.render_chat(user)
    with pytest.raises(InvalidArgument, match="^messages: the chat template refused them"):
        configure({"chat_template": "{{ 1 + messages }}"}).render_chat(user)
    with pytest.raises(ValueError, match="does not compile"):
        configure({"chat_template": "{% if %}"})
    with pytest.raises(ValueError, match="chat_template"):
        configure({"chat_template": 5})
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff{{ 1 }}")   # raised without the file's name
    with pytest.raises(ValueError, match=r"chat_template.jinja: 'utf-8' codec can't decode"):
        PromptTokenizer.from_model_dir(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        PromptTokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="cannot load it as a tokenizer"):
        PromptTokenizer.from_model_dir(tmp_path)


def small_encode(text: str) -> list[int]:
    return build_sid_tokenizer(SMALL).encode(text).ids


def test_prompts_get_the_post_processor_and_chats_do_not(tmp_path):
    from tokenizers import processors

    tokenizer = build_sid_tokenizer(SMALL)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", SMALL.first_special_id)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    bos = PromptTokenizer.from_model_dir(tmp_path)
    assert bos.encode("<s_a_1>") == [SMALL.first_special_id, SMALL.itemic_id(0, 1)]
    assert bos.encode_chat([{"role": "user", "content": "<s_a_1>"}]) == [SMALL.itemic_id(0, 1)]


def test_encode_from_many_threads(small):
    texts = [f"{prompt} {n} <s_a_{n % 16}><s_b_{n * 7 % 16}> " * (1 + n % 5)
             for n in range(200) for prompt in PROMPTS[1:3]]
    serial = [small.encode(text) for text in texts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(3):
            futures = [pool.submit(small.encode, text) for text in texts]
            chats = [pool.submit(small.encode_chat, [{"role": "user", "content": text}])
                     for text in texts[:50]]
            assert [future.result(timeout=60) for future in futures] == serial
            assert all(future.result(timeout=60) == small.encode_chat(
                [{"role": "user", "content": text}]) for future, text in zip(chats, texts))


def test_random_sid_catalog():
    catalog = random_sid_catalog(1000, SMALL, seed=3)
    assert catalog.num_items == 1000 and catalog.vocab_size == SMALL.vocab_size == 768
    assert len(set(catalog.item_ids.tolist())) == 1000 and catalog.item_ids.min() >= 1
    for level in range(3):
        codes = catalog.triples[:, level] - SMALL.level_start(level)
        assert codes.min() >= 0 and codes.max() < 16
        assert len(np.unique(codes)) == 16  # uniform over the codebook: 1000 draws hit all 16
    again = random_sid_catalog(1000, SMALL, seed=3)
    assert (again.item_ids == catalog.item_ids).all() and (again.triples == catalog.triples).all()
    assert not (random_sid_catalog(1000, SMALL, seed=4).triples == catalog.triples).all()
    assert random_sid_catalog(0, SMALL).num_items == 0
    with pytest.raises(ValueError, match="num_items"):
        random_sid_catalog(-1, SMALL)
    with pytest.raises(ValueError, match="num_levels"):
        random_sid_catalog(5, SidLayout(512, 16, num_levels=2))
