"""OpenOneRec-layout vocabularies for random demo and test models, built offline.

OpenOneRec extends Qwen3's tokenizer: the regular BPE tokens (ids
`0 .. num_base_tokens - 1`, 151,643 in Qwen3), Qwen3's 26 special tokens, then
the itemic tokens `<s_a_0> .. <s_a_{K-1}>`, `<s_b_*>`, `<s_c_*>` (K = codebook
size, 8192) and `<|sid_begin|>`, `<|sid_end|>`; the model's vocabulary is that
padded to a multiple of 256 (176,384). `SidLayout` is that arithmetic;
`write_sid_tokenizer` writes a tokenizer with exactly those ids without
downloading Qwen's: a byte-level BPE trained here on a small built-in corpus,
its vocabulary padded with unreachable filler entries up to `num_base_tokens`.
Its pipeline (NFC, Qwen2's split pattern, byte level) is Qwen2's, so
`transformers.AutoTokenizer` and `xrec.tokenizer.PromptTokenizer` load it alike.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xrec.catalog.items import ItemCatalog, random_catalog
from xrec.catalog.formats import NUM_LEVELS, check_vocab_size
from xrec.config.sizes import SID_VOCABULARIES

__all__ = ["QWEN3_SPECIAL_TOKENS", "SidLayout", "build_sid_tokenizer", "random_catalog_of_size",
           "random_sid_catalog", "sid_layout_of", "write_sid_tokenizer"]

QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
SID_BEGIN, SID_END = "<|sid_begin|>", "<|sid_end|>"
VOCAB_MULTIPLE = 256
MIN_BASE_TOKENS = 256  # the byte-level alphabet: every text must encode
MAX_TRAINED_TOKENS = 4096
# Qwen2's pre-tokenization pattern (its tokenizer.json and transformers' Qwen2Tokenizer)
QWEN2_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                       r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML with Qwen3's empty think block when thinking is off; only these three roles
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "{{- raise_exception('unsupported role ' + message['role']|tojson"
    " + ': expected system, user or assistant') }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)


@dataclass(frozen=True)
class SidLayout:
    """Token ids of an OpenOneRec-style vocabulary.

    ids: [0, B) regular tokens | [B, B + 26) Qwen3 specials | num_levels blocks of
    `codebook_size` itemic tokens | <|sid_begin|>, <|sid_end|> | padding up to
    `vocab_size`, a multiple of 256 (B = num_base_tokens).
    """

    num_base_tokens: int = 151_643
    codebook_size: int = 8192
    num_levels: int = NUM_LEVELS

    def __post_init__(self):
        for name, low, high in (("num_base_tokens", MIN_BASE_TOKENS, None),
                                ("codebook_size", 1, None), ("num_levels", 1, 26)):
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool) or value < low
                    or (high is not None and value > high)):
                allowed = f"[{low}, {high}]" if high else f">= {low}"
                raise ValueError(f"SidLayout {name}: got {value!r}, expected an integer {allowed}")

    @property
    def first_special_id(self) -> int:
        return self.num_base_tokens

    @property
    def first_itemic_id(self) -> int:
        return self.num_base_tokens + len(QWEN3_SPECIAL_TOKENS)

    def level_start(self, level: int) -> int:
        """Id of the level's code 0 (level 0 is `<s_a_*>`)."""
        if not 0 <= level < self.num_levels:
            raise ValueError(f"level: got {level!r}, expected 0 <= level < {self.num_levels}")
        return self.first_itemic_id + level * self.codebook_size

    def itemic_id(self, level: int, code: int) -> int:
        if not 0 <= code < self.codebook_size:
            raise ValueError(f"code: got {code!r}, expected 0 <= code < {self.codebook_size}")
        return self.level_start(level) + code

    def itemic_token(self, level: int, code: int) -> str:
        """`<s_a_12>` for level 0, code 12."""
        self.itemic_id(level, code)
        return f"<s_{chr(ord('a') + level)}_{code}>"

    @property
    def sid_begin_id(self) -> int:
        return self.first_itemic_id + self.num_levels * self.codebook_size

    @property
    def sid_end_id(self) -> int:
        return self.sid_begin_id + 1

    @property
    def num_tokens(self) -> int:
        """Ids that have a token (the tokenizer's size); the rest up to vocab_size is padding."""
        return self.sid_end_id + 1

    @property
    def vocab_size(self) -> int:
        return -(-self.num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def added_tokens(self) -> list[str]:
        """The tokens after the regular ones, in id order (specials, itemic, markers)."""
        itemic = [self.itemic_token(level, code) for level in range(self.num_levels)
                  for code in range(self.codebook_size)]
        return [*QWEN3_SPECIAL_TOKENS, *itemic, SID_BEGIN, SID_END]


def _training_corpus() -> list[str]:
    """A few thousand deterministic English and chat lines for the BPE merges."""
    subjects = ("The user", "A viewer", "My friend", "She", "He", "They", "We", "You")
    verbs = ("watched", "liked", "shared", "searched for", "bought", "skipped", "saved",
             "commented on")
    objects = ("a cooking video", "a short clip about cats", "the latest football highlights",
               "a travel vlog from Japan", "a music video", "an unboxing of a new phone",
               "a tutorial on painting", "a live stream of a game")
    times = ("yesterday.", "this morning.", "last night!", "on Sunday?", "twice, then left.",
             "again and again.")
    lines = [" ".join(words) for words in itertools.product(subjects, verbs, objects, times)]
    chat = ("You are a helpful recommendation assistant.", "What should I watch next?",
            "Recommend items similar to the ones I liked.",
            "Here are the items the user interacted with recently:",
            "Sure, here are some recommendations for you.", "I don't like horror movies.",
            "Thanks! Can you show me more like the second one?",
            "Café crème, naïve façade, 推荐视频")
    lines += [f"{line} (item {n}, {n * 37 % 1000} views)" for n, line in
              enumerate(itertools.islice(itertools.cycle(chat), 400))]
    return lines


def _regular_vocab(num_base_tokens: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE trained on the built-in corpus, padded to exactly num_base_tokens ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.NFC()
    trainer_tokenizer.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=min(num_base_tokens, MAX_TRAINED_TOKENS),
                                  min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_tokenizer.train_from_iterator(_training_corpus(), trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = dict(model["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # fillers: '<' and digits are split apart by the pattern, so no text reaches them
    for token_id in range(len(vocab), num_base_tokens):
        vocab[f"<xrec_unused_{token_id}>"] = token_id
    return vocab, merges


def _pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def build_sid_tokenizer(layout: SidLayout):
    """The `tokenizers.Tokenizer` of `layout` (ids checked against the layout)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab, merges = _regular_vocab(layout.num_base_tokens)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                    use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                           use_regex=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in QWEN3_SPECIAL_TOKENS])
    # OpenOneRec added these with `add_tokens`: regular (non-special) added tokens
    tokenizer.add_tokens(layout.added_tokens()[len(QWEN3_SPECIAL_TOKENS):])
    if tokenizer.get_vocab_size(with_added_tokens=False) != layout.num_base_tokens:
        raise RuntimeError(f"sid tokenizer: {tokenizer.get_vocab_size(False)} regular tokens, "
                           f"the layout has {layout.num_base_tokens}")
    for token_id, token in enumerate(layout.added_tokens(), start=layout.first_special_id):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"sid tokenizer: {token!r} got id {tokenizer.token_to_id(token)}, "
                               f"the layout needs {token_id}")
    if tokenizer.get_vocab_size(with_added_tokens=True) != layout.num_tokens:
        raise RuntimeError(f"sid tokenizer: {tokenizer.get_vocab_size()} tokens, the layout has "
                           f"{layout.num_tokens}")
    return tokenizer


def write_sid_tokenizer(out_dir: str | os.PathLike, layout: SidLayout,
                        model_max_length: int = 131_072) -> None:
    """Writes `tokenizer.json` and `tokenizer_config.json` (merged into an existing one:
    other keys such as "item_catalog" stay) for `layout` into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_sid_tokenizer(layout).save(str(out / "tokenizer.json"))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    # unk_token null: left out, transformers' Qwen2Tokenizer shows its templates its class
    # default (<|endoftext|>), which xrec's template environment does not know
    config.update(tokenizer_class="Qwen2Tokenizer", chat_template=CHATML_TEMPLATE,
                  bos_token=None, unk_token=None, eos_token="<|im_end|>",
                  pad_token="<|endoftext|>", model_max_length=model_max_length, add_prefix_space=False)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                           encoding="utf-8")


def random_sid_catalog(num_items: int, layout: SidLayout, seed: int = 0) -> ItemCatalog:
    """`num_items` unique ids in [1, 2**62] (as `catalog.random_catalog`), codes uniform over
    the codebook at every level, as the layout's itemic token ids."""
    if not isinstance(num_items, (int, np.integer)) or isinstance(num_items, bool) or num_items < 0:
        raise ValueError(f"num_items: got {num_items!r}, expected an integer >= 0")
    if layout.num_levels != NUM_LEVELS:
        raise ValueError(f"layout.num_levels: got {layout.num_levels}, the catalog holds "
                         f"{NUM_LEVELS} levels")
    vocab_size = check_vocab_size(layout.vocab_size)
    rng = np.random.default_rng(seed)
    item_ids = rng.choice(1 << 62, size=num_items, replace=False) + 1  # [n] int64
    codes = rng.integers(0, layout.codebook_size, size=(num_items, NUM_LEVELS))  # [n, 3]
    starts = np.array([layout.level_start(level) for level in range(NUM_LEVELS)])  # [3]
    return ItemCatalog(item_ids, (codes + starts).astype(np.int32), vocab_size)


def sid_layout_of(size: str, vocab_size: int) -> SidLayout | None:
    """The vocabulary layout of a named decoder-only size (`config.sizes.SID_VOCABULARIES`),
    checked against the size's `vocab_size`; None for a size without one."""
    if size not in SID_VOCABULARIES:
        return None
    num_base, codebook = SID_VOCABULARIES[size]
    layout = SidLayout(num_base_tokens=num_base, codebook_size=codebook)
    if layout.vocab_size != vocab_size:  # the size table and the layout must agree
        raise ValueError(f"size {size}: vocab_size {vocab_size} != the layout's {layout.vocab_size}")
    return layout


def random_catalog_of_size(size: str, vocab_size: int, num_items: int, seed: int = 0) -> ItemCatalog:
    """The random catalog `xrec make-model` writes for a named size: over the itemic tokens
    of its layout (`random_sid_catalog`), or uniform over the vocabulary (`random_catalog`)."""
    layout = sid_layout_of(size, vocab_size)
    if layout is None:
        return random_catalog(num_items, vocab_size, seed)
    return random_sid_catalog(num_items, layout, seed)
