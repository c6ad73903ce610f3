"""A model directory's tokenizer and chat template, for `prompt` and `messages` requests.

Why `tokenizers` + `jinja2` and not `transformers`: they are what
`transformers` itself runs underneath (its fast tokenizers are `tokenizers`
objects, its chat templates jinja2 sandboxes), at a fraction of the installed size
and import time (docs/decisions.md, Decoder-only family). Serving never imports
transformers.

The template environment is the one Hugging Face templates are written for:
an `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with
`loopcontrols`, the `{% generation %}...{% endgeneration %}` block (Hugging Face
marks the assistant's tokens with it for training masks; it renders its body as
it is), transformers' `tojson` filter (it keeps non-ASCII text unless
`ensure_ascii=true`), and the `raise_exception(message)` and
`strftime_now(format)` globals. The template
also sees the special tokens that `tokenizer_config.json` names (`bos_token`,
`eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`; over
them `special_tokens_map.json`'s, where the config has no `added_tokens_decoder`),
as Hugging Face's `special_tokens_map` passes them: those set, as strings; one
that is null or absent is undefined there (renders as "", never "None"); and
`tools` and `documents` as None (xrec takes neither), as transformers passes them.

Truncation and padding: a `tokenizer.json` may be saved with either on (its
"truncation" / "padding" keys). Hugging Face's tokenizer call turns both off
unless the caller asks for them, so a prompt, a chat and a generation prefix
are encoded whole and unpadded there; `PromptTokenizer` turns them off at load
too (they cut a prompt short, the generation prompt included, or padded it,
a generation prefix too, with pad tokens).

Thread safety: the `tokenizers.Tokenizer` is shared by all request threads
and only read. `encode`, `token_to_id`, `id_to_token` borrow it immutably
(PyO3), and immutable borrows may coexist. The "RuntimeError: Already
borrowed" reported against Hugging Face tokenizers under load comes from a
*mutable* borrow (setting truncation or padding, adding tokens) while another
thread encodes; this class never mutates the tokenizer after loading it.
Plain `encode` also keeps the GIL in tokenizers 0.23 (docs/decisions.md,
Decoder-only family), so concurrent prompts are encoded one after another, not
in parallel; prompts are short. `tests/test_tokenizer.py` encodes from 8 threads
at once and compares with the serial results. A
compiled jinja2 template is safe to render from several threads (each render
has its own context).

Long prompts: `min_num_tokens(text)` bounds the token count from below without the
BPE work (about 0.7 s for 1 MB of text), so that the server refuses a prompt that
cannot fit before it encodes it: no token covers more characters of the normalized
text than the longest token string has (a byte-level token's characters are bytes,
at least as many as the characters they encode; an added token's string is counted
normalized, as it is matched). The bound holds when the pipeline drops no character
and fuses no run of unknown characters into one token, which is checked once at load
(`max_token_chars` is None otherwise).
"""

from __future__ import annotations

import itertools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from xrec.errors import InvalidArgument
from xrec.utils.files import read_regular_file

__all__ = ["PromptTokenizer"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
# pre-tokenizers that keep every character (Split and Punctuation unless "removed")
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Metaspace", "Digits", "Punctuation",
                          "UnicodeScripts", "Sequence"}
# normalizers that leave ASCII text as it is (others are run to measure the text)
ASCII_KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents",
                             "Sequence"}
# the keys a message's reasoning may come under, in transformers' order of preference; the
# template sees it as `reasoning_content` (Qwen3's) and as `thinking` (gpt-oss's)
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# the named special tokens a chat template sees (Hugging Face's SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")


def _template_environment():
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' signature, `ensure_ascii` first (jinja2's own takes `indent` first)
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}body{% endgeneration %}`: the body (no assistant mask here)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


MAX_TEXT_FILE_BYTES = 64 << 20   # a tokenizer_config.json or chat template is KiBs


def _read_text(path: Path) -> str:
    """A UTF-8 regular file of bounded size (`FileRefused` or UnicodeDecodeError, both
    ValueErrors, without the path: callers name it)."""
    return read_regular_file(path, MAX_TEXT_FILE_BYTES).decode("utf-8")


def _read_config(model_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json, its named special tokens from special_tokens_map.json when it
    has no "added_tokens_decoder" (as transformers 4.33 and older saved a directory):
    transformers reads them so, the map's winning over the config's."""
    config = _read_json_object(model_dir / CONFIG_FILE)
    if "added_tokens_decoder" in config:
        return config
    legacy = _read_json_object(model_dir / SPECIAL_TOKENS_MAP_FILE)
    return {**config, **{key: legacy[key] for key in SPECIAL_TOKEN_KEYS if key in legacy}}


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when there is none."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path))
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _find_template(model_dir: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """(the template or None, where it came from or, when None, where xrec looked)."""
    template_path, config_path = model_dir / TEMPLATE_FILE, model_dir / CONFIG_FILE
    if template_path.is_file():
        try:
            return _read_text(template_path), str(template_path)
        except ValueError as exc:
            raise ValueError(f"{template_path}: {exc}") from None
    template, looked = config.get("chat_template"), ""
    if isinstance(template, list):  # named templates [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template, looked = named.get("default"), ", whose list has no \"default\" template"
    if not template:
        return None, f"{template_path}, then the \"chat_template\" key of {config_path}{looked}"
    if not isinstance(template, str):
        raise ValueError(f"{config_path}: chat_template = {template!r:.80}, expected a string")
    return template, f"the \"chat_template\" key of {config_path}"


def _state(component: Any) -> dict:
    """A tokenizers pipeline component's JSON (normalizer, pre-tokenizer); {} for None."""
    return {} if component is None else json.loads(component.__getstate__())


def _types(state: Any) -> set[str]:
    """The "type" names of a serialized component and of the components nested in it."""
    if isinstance(state, dict):
        own = {state["type"]} if isinstance(state.get("type"), str) else set()
        return own.union(*(_types(value) for value in state.values()))
    if isinstance(state, list):
        return set().union(*(_types(value) for value in state))
    return set()


def _max_token_chars(tokenizer: Any) -> int | None:
    """The longest token's characters when no token covers more characters of the normalized
    text than its string has (`min_num_tokens`), else None: a BPE model that never fuses
    unknown characters into one token, no added token that swallows the whitespace beside
    it, and pre-tokenizers that drop nothing (truncation is off: `PromptTokenizer`)."""
    model = tokenizer.model
    if type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk):
        return None
    if any(t.lstrip or t.rstrip for t in tokenizer.get_added_tokens_decoder().values()):
        return None
    pre = _state(tokenizer.pre_tokenizer)
    if not _types(pre) <= KEEPING_PRE_TOKENIZERS or "removed" in json.dumps(pre).lower():
        return None
    # an added token covers its content normalized (NFKC makes "\ufdfa" 18 characters)
    normalize = tokenizer.normalizer.normalize_str if tokenizer.normalizer else str
    added = (normalize(t.content) for t in tokenizer.get_added_tokens_decoder().values())
    tokens = itertools.chain(tokenizer.get_vocab(with_added_tokens=True), added)
    return max(map(len, tokens), default=0) or None


def _special_token(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _loops_over_content(template_ast: Any) -> bool:
    """Whether a template loops over a message's content (`{% for part in m['content'] %}`,
    `m` a loop variable over `messages` or over a name set from it): it reads OpenAI parts
    (vLLM's "openai" content format, detected as vLLM detects it); else it reads text."""
    from jinja2 import nodes

    def base(node):   # through filters, tests and slices: `messages[1:]|reverse` is `messages`
        while isinstance(node, (nodes.Filter, nodes.Test)) or (
                isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        return node

    def is_one_of(node, names):
        node = base(node)
        return isinstance(node, nodes.Name) and node.name in names

    lists, assigns = {"messages"}, list(template_ast.find_all(nodes.Assign))
    while more := {a.target.name for a in assigns if isinstance(a.target, nodes.Name)
                   and is_one_of(a.node, lists)} - lists:   # `{% set loop_messages = ... %}`
        lists |= more
    loops = list(template_ast.find_all(nodes.For))
    items = {loop.target.name for loop in loops
             if isinstance(loop.target, nodes.Name) and is_one_of(loop.iter, lists)}

    def is_content(node):   # `item.content` or `item['content']`
        node = base(node)
        if isinstance(node, nodes.Getattr):
            key = node.attr
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            key = node.arg.value
        else:
            return False
        return key == "content" and is_one_of(node.node, items)

    return any(is_content(loop.iter) for loop in loops)


def _message_content(content: Any, index: int, is_parts_kept: bool) -> str | list:
    """A message's content: a string, or OpenAI text parts, as they are for a template that
    loops over them (`is_parts_kept`), else their texts joined with newlines (as vLLM does)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        for part_index, part in enumerate(content):
            if (not isinstance(part, dict) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)):
                raise InvalidArgument(f"messages: [{index}].content[{part_index}]: got "
                                      f"{part!r:.80}, expected "
                                      f"{{\"type\": \"text\", \"text\": str}}")
        return list(content) if is_parts_kept else "\n".join(part["text"] for part in content)
    raise InvalidArgument(f"messages: [{index}].content: got {content!r:.80}, expected a string "
                          f"or a non-empty list of {{\"type\": \"text\", \"text\": str}} parts")


def _check_messages(messages: Any, is_parts_kept: bool) -> list[dict[str, Any]]:
    """The messages as the template sees them: each a copy whose null keys are left out (as
    transformers does: `"name": null` is undefined in the template, not "None"), its content
    text or parts (`_message_content`), its reasoning (`reasoning_content`, `thinking` or
    `reasoning`, as clients name it) under `reasoning_content` and `thinking` too (as
    transformers passes it)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgument(f"messages: got {messages!r:.80}, expected a non-empty list of "
                              f"{{\"role\": str, \"content\": str}} objects")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgument(f"messages: [{index}]: got {message!r:.80}, expected a "
                                  f"{{\"role\": str, \"content\": str}} object")
        content = _message_content(message.get("content"), index, is_parts_kept)
        message = {**{key: value for key, value in message.items() if value is not None},
                   "content": content}
        reasoning = next((message[key] for key in REASONING_KEYS if key in message), None)
        if reasoning is not None:   # as transformers' `_alias_reasoning_fields`
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        checked.append(message)
    return checked


class PromptTokenizer:
    """A model directory's `tokenizer.json` and chat template; read-only, shared by threads.

    Encodes `prompt` text (with the tokenizer's post-processor) and renders
    `messages` with the chat template (`add_generation_prompt=True`,
    `enable_thinking=False`), then encodes that without special tokens added,
    as Hugging Face's `apply_chat_template` does.
    """

    def __init__(self, tokenizer, chat_template: str | None = None,
                 special_tokens: dict[str, str | None] | None = None,
                 template_source: str = "the model directory"):
        # as Hugging Face's tokenizer call: the whole text, unpadded, whatever tokenizer.json
        # says (at load, before any thread encodes)
        if tokenizer.truncation is not None:
            tokenizer.no_truncation()
        if tokenizer.padding is not None:
            tokenizer.no_padding()
        # BPE dropout saved in tokenizer.json skips merges at random, a different split of the
        # same prompt each time; transformers' Qwen2Tokenizer builds its BPE without it
        if getattr(tokenizer.model, "dropout", None):
            tokenizer.model.dropout = None
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer
        # None is left out: undefined in the template, as in Hugging Face's (not "None")
        self._special_tokens = {key: value for key, value in (special_tokens or {}).items()
                                if value is not None}
        self._template_source = template_source  # where it came from, or where xrec looked
        self._template = None
        self._is_parts_kept = False   # the template loops over OpenAI content parts
        self.max_token_chars = _max_token_chars(tokenizer)   # None: no bound (min_num_tokens)
        self._is_ascii_kept = _types(_state(tokenizer.normalizer)) <= ASCII_KEEPING_NORMALIZERS
        if chat_template:
            try:
                environment = _template_environment()
                self._template = environment.from_string(chat_template)
            except Exception as exc:  # a jinja2 syntax error: refuse the directory at load
                raise ValueError(f"{template_source}: the chat template does not compile "
                                 f"({exc})") from exc
            self._is_parts_kept = _loops_over_content(environment.parse(chat_template))

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> PromptTokenizer | None:
        """The directory's tokenizer, or None when it has no tokenizer.json."""
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception for a bad file
            raise ValueError(f"{path}: cannot load it as a tokenizer ({exc})") from exc
        config = _read_config(model_dir)
        template, source = _find_template(model_dir, config)
        special = {key: _special_token(config, key) for key in SPECIAL_TOKEN_KEYS}
        # "split_special_tokens": special tokens written in the text are encoded as text, as
        # transformers sets it on the same tokenizer (a rendered chat's included, there too)
        tokenizer.encode_special_tokens = config.get("split_special_tokens") is True
        return cls(tokenizer, template, special, source)

    # --- vocabulary ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Tokens, added tokens included (the model's vocab_size may be padded beyond it)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token) if isinstance(token, str) else None

    def id_to_token(self, token_id: int) -> str | None:
        if not isinstance(token_id, (int, np.integer)) or not 0 <= token_id < 1 << 32:
            return None
        return self._tokenizer.id_to_token(int(token_id))

    def tokens_text(self, ids) -> str | None:
        """The token strings concatenated, e.g. "<s_a_340><s_b_6566><s_c_5603>"; None when an
        id has none: a model's vocabulary is often padded beyond its tokenizer's (OpenOneRec:
        176,384 ids, 176,247 tokens), and unconstrained search may reach those ids."""
        tokens = [self.id_to_token(token_id) for token_id in ids]
        return None if None in tokens else "".join(tokens)

    def known_ids(self, ids: np.ndarray) -> np.ndarray:
        """[n] bool: which of the non-negative `ids` have a token."""
        id_to_token = self._tokenizer.id_to_token  # faster than building get_vocab()'s dict
        return np.fromiter((id_to_token(i) is not None for i in ids.tolist()), dtype=bool,
                           count=len(ids))  # [n]

    # --- requests -----------------------------------------------------------------------

    def min_num_tokens(self, text: str, field: str = "prompt") -> int:
        """A lower bound on `len(encode(text))` found without the BPE work: the normalized
        text's characters over `max_token_chars` (0 when no bound holds). Tens of
        milliseconds for a megabyte of non-ASCII text (the normalizer), microseconds for ASCII.
        Errors name `field`, as `encode`'s do."""
        if self.max_token_chars is None or not isinstance(text, str):
            return 0
        normalizer = self._tokenizer.normalizer
        if normalizer is not None and not (text.isascii() and self._is_ascii_kept):
            try:
                text = normalizer.normalize_str(text)
            except (TypeError, UnicodeEncodeError):   # a lone surrogate, named here
                _check_encodable(field, text)
                raise
        return -(-len(text) // self.max_token_chars)

    def encode(self, text: str, add_special_tokens: bool = True,
               field: str = "prompt") -> list[int]:
        """Token ids of `prompt` text, the tokenizer's post-processor applied (unless
        `add_special_tokens` is false: a generation prefix continues a prompt, a rendered
        chat has its special tokens); errors name `field`."""
        if not isinstance(text, str):
            raise InvalidArgument(f"{field}: got {type(text).__name__}, expected a string")
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:   # "TextInputSequence must be str": a lone surrogate, named here
            _check_encodable(field, text)
            raise

    def render_chat(self, messages: Any) -> str:
        """The chat template's text for `messages`, ending with the assistant's turn."""
        if self._template is None:
            raise InvalidArgument(f"messages: this model has no chat template (xrec looks for "
                                  f"{self._template_source}); send `prompt` or `token_ids`")
        checked = _check_messages(messages, self._is_parts_kept)
        try:
            # `tools` and `documents` are None, not undefined, as transformers passes them:
            # `{% if tools is not none %}` is false
            return self._template.render(messages=checked, tools=None, documents=None,
                                         add_generation_prompt=True, enable_thinking=False,
                                         **self._special_tokens)
        except Exception as exc:  # raise_exception, undefined names, type errors in the template
            raise InvalidArgument(f"messages: the chat template refused them: {exc}") from exc

    def encode_chat(self, messages: Any) -> list[int]:
        """Token ids of the rendered chat; no special tokens added (the template has them)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False, field="messages")


def _check_encodable(field: str, text: str) -> None:
    """InvalidArgument naming a lone UTF-16 surrogate ("\\ud800", which JSON cannot carry
    but Python strings can) in `text`: the tokenizer refuses it with a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{field}: character {exc.start} is a lone surrogate "
                              f"({text[exc.start]!r}), not text") from None
