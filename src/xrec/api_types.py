"""Public request/response dataclasses and request validation (the edge of the engine)."""

from __future__ import annotations

import math
import numbers
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from xrec.errors import InvalidArgument

NORMALIZATIONS = ("allowed", "full")
# Below this a temperature changes no ranking, only inflates scores toward float32 overflow
# (docs/decisions.md, "Temperature floor"); 0 means 1.
MIN_TEMPERATURE = 1e-6


@dataclass
class RecRequest:
    """One user's recommendation request. Exactly one input: `token_ids`, or
    `sparse_embedding` (encoder-decoder models), or `prompt` text or chat `messages`
    (models with a tokenizer; tokenized at the edge, before the request is queued).

    Unset search knobs take the engine's defaults: `beam_width` ->
    `default_beam_width`, `top_k` and `num_return_sequences` -> `beam_width`,
    `normalize` -> the engine's `normalize`.

    Filters (constrained engines; docs/beam-search.md, "Filters"): the answer is that of the
    same request over a catalog without the filtered-out items. `exclude_items`: catalog
    item ids never to recommend (ids the catalog does not hold are ignored and counted in
    `usage["excluded_items_unknown"]`); `item_types`: an allow-list of item `type`s
    (extended catalogs); `exclude_history`: decoder-only models with a tokenizer, every
    item whose semantic ID appears in the prompt.
    """

    token_ids: Sequence[int] | None = None
    sparse_embedding: Any = None                 # array-like [L, d_model], float32
    decoder_context_embedding: Any = None        # array-like [C, d_model], float32
    prompt: str | None = None                    # text, tokenized with the model's tokenizer.json
    messages: Sequence[dict] | None = None       # chat, rendered with the model's chat template
    beam_width: int | None = None
    top_k: int | None = None
    num_return_sequences: int | None = None
    normalize: str | None = None
    temperature: float | None = 1.0            # None or 0 means 1
    return_items: bool = True
    timeout_ms: float | None = None
    request_id: str | None = None
    seed: int | None = None                      # random (but reproducible) item choice when capped
    exclude_items: Sequence[int] | None = None   # catalog item ids (unknown ones are ignored)
    item_types: Sequence[str] | None = None      # allow-list of item types (extended catalogs)
    exclude_history: bool = False                # exclude the items the prompt names


@dataclass(frozen=True)
class RecItem:
    item_id: int
    did: str | None = None
    type: str | None = None


@dataclass(frozen=True)
class RecCandidate:
    """One finished beam: the semantic ID, its score (sum of per-round log-probs), its items,
    and its tokens as text (`"<s_a_340><s_b_6566><s_c_5603>"`) when the model has a tokenizer."""

    tokens: tuple[int, ...]
    score: float
    token_logprobs: tuple[float, ...]
    items: list[RecItem] = field(default_factory=list)
    text: str | None = None


@dataclass(frozen=True)
class RecResponse:
    """`catalog_version`: the content hash of the catalog the request's batch ran on (None
    without a catalog); a catalog swap never changes it mid-batch."""

    request_id: str
    results: list[RecCandidate]
    usage: dict[str, int]
    timing: dict[str, float]
    catalog_version: str | None = None


@dataclass(frozen=True)
class CatalogVersion:
    """One loaded catalog, as `Engine.catalog_version` and `GET /v1/admin/catalog` show it.

    `content_hash`: 16 hex digits of the SHA-256 of the catalog's content (item ids,
    triples, and did/type strings when extended, in catalog order), so the same content
    has the same hash whatever its file format. `loaded_at`: Unix time in seconds.
    `source`: the file it was read from (None: given as an `ItemCatalog`).
    """

    content_hash: str
    num_items: int
    loaded_at: float
    source: str | None = None
    is_extended: bool = False

    def to_dict(self) -> dict:
        return {"content_hash": self.content_hash, "num_items": self.num_items,
                "loaded_at": round(self.loaded_at, 3), "source": self.source,
                "is_extended": self.is_extended}


@dataclass(frozen=True)
class SearchLimits:
    """What the engine accepts; built from the engine options and the model config.

    `accepts_embeddings`: the family reads `sparse_embedding` / context rows
    (encoder-decoder) or token ids only (decoder-only). `decoder_start_len`: rows of
    the decoder prefix when no context is given (1: BOS; 0: the prompt is the prefix).
    `max_positions`: prompt positions the model can hold with its generated tokens
    (None: no limit). `generation_prefix`: ids appended to every prompt.
    """

    vocab_size: int
    d_model: int
    max_input_len: int
    max_beam_width: int
    max_top_k: int
    default_beam_width: int
    default_normalize: str
    accepts_embeddings: bool = True
    decoder_start_len: int = 1
    max_positions: int | None = None
    generation_prefix: tuple[int, ...] = ()
    is_constrained: bool = False      # a catalog constrains the search (filters need one)
    max_exclude_items: int = 100_000


@dataclass(frozen=True)
class ValidRequest:
    """A request after validation: defaults applied, arrays as contiguous float32 / int64."""

    request_id: str
    token_ids: np.ndarray | None          # [L] int64 (a prompt's ids, generation prefix included)
    sparse_embedding: np.ndarray | None   # [L, D] float32
    context: np.ndarray | None            # [C, D] float32
    beam_width: int
    top_k: int
    num_results: int
    normalize: str
    temperature: float
    return_items: bool
    timeout_ms: float | None
    seed: int | None
    prefix_len: int = 1                   # decoder-prefix rows (BOS, context rows, or 0)
    exclude_items: np.ndarray | None = None   # [E] int64, sorted, unique
    item_types: tuple[str, ...] | None = None  # sorted, unique
    exclude_history: bool = False

    @property
    def input_len(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else len(self.sparse_embedding)

    @property
    def has_filter(self) -> bool:
        return self.exclude_items is not None or self.item_types is not None or self.exclude_history


def validate(request: RecRequest, limits: SearchLimits, tokenizer: Any = None) -> ValidRequest:
    """Check every field; raise `InvalidArgument` naming the field, the value and what is allowed.
    `tokenizer` (a `PromptTokenizer`, or None) turns `prompt` / `messages` into token ids."""
    rid = request.request_id
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
        raise InvalidArgument(f"request_id: got {rid!r}, expected a non-empty string of at most 256 chars")
    rid = rid or uuid.uuid4().hex
    try:
        return _validate(request, limits, rid, tokenizer)
    except InvalidArgument as e:
        e.request_id = rid
        raise


def _validate(request: RecRequest, limits: SearchLimits, rid: str, tokenizer: Any) -> ValidRequest:
    inputs = ("token_ids", "sparse_embedding", "prompt", "messages")
    given = [name for name in inputs if getattr(request, name) is not None]
    if len(given) != 1:
        offered = "token_ids / sparse_embedding" if limits.accepts_embeddings else \
            "token_ids / prompt / messages"
        got = "neither" if not given else "both " + " and ".join(given)
        raise InvalidArgument(f"give exactly one of {offered}, got {got}")
    field_name = given[0]
    if not limits.accepts_embeddings:
        for name in ("sparse_embedding", "decoder_context_embedding"):
            if getattr(request, name) is not None:
                raise InvalidArgument(f"{name}: this model is decoder-only and reads token ids; "
                                      "give token_ids, prompt or messages")
    token_ids = embedding = None
    if field_name == "sparse_embedding":
        embedding = _matrix("sparse_embedding", request.sparse_embedding, limits.d_model)
        length = len(embedding)
    else:
        token_ids = _prompt_ids(request, field_name, limits, tokenizer)
        length = len(token_ids)
    if length == 0:
        raise InvalidArgument(f"{field_name}: empty input; at least one position is required")
    if length > limits.max_input_len:
        raise InvalidArgument(f"{field_name}: {length} positions"
                              f"{' (with the generation prefix)' if limits.generation_prefix else ''}, "
                              f"more than max_input_len={limits.max_input_len}")
    if limits.max_positions is not None and length > limits.max_positions:
        raise InvalidArgument(f"{field_name}: {length} positions, more than the model holds with its "
                              f"generated tokens ({limits.max_positions}: max_position_embeddings "
                              "less the decode rounds after the first)")
    context = None
    if request.decoder_context_embedding is not None:
        context = _matrix("decoder_context_embedding", request.decoder_context_embedding, limits.d_model)
        if len(context) == 0:
            raise InvalidArgument("decoder_context_embedding: 0 rows; give at least one row or omit it")
        if len(context) > limits.max_input_len:
            raise InvalidArgument(f"decoder_context_embedding: {len(context)} rows, more than "
                                  f"max_input_len={limits.max_input_len}")
    width = _int("beam_width", request.beam_width, limits.default_beam_width, 1, limits.max_beam_width)
    top_k = _int("top_k", request.top_k, width, width, limits.max_top_k)
    num_results = _int("num_return_sequences", request.num_return_sequences, width, 1,
                       limits.max_top_k)
    normalize = request.normalize if request.normalize is not None else limits.default_normalize
    if normalize not in NORMALIZATIONS:
        raise InvalidArgument(f"normalize: got {normalize!r}, allowed: {', '.join(NORMALIZATIONS)}")
    temperature = _finite(1.0 if request.temperature is None else request.temperature)
    if temperature is None or not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise InvalidArgument(f"temperature: got {_short(request.temperature)}, allowed: 0 "
                              f"(meaning 1) or a finite number >= {MIN_TEMPERATURE:g}")
    timeout = None if request.timeout_ms is None else _finite(request.timeout_ms)
    if request.timeout_ms is not None and (timeout is None or timeout <= 0):
        raise InvalidArgument(f"timeout_ms: got {_short(request.timeout_ms)}, expected a "
                              f"positive number")
    if not isinstance(request.return_items, (bool, np.bool_)):
        raise InvalidArgument(f"return_items: got {request.return_items!r}, expected true or false")
    seed = request.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or seed < 0):
        raise InvalidArgument(f"seed: got {seed!r}, expected an integer >= 0")
    prefix_len = limits.decoder_start_len if context is None else len(context)
    exclude_items, item_types, exclude_history = _filters(request, limits, tokenizer)
    return ValidRequest(rid, token_ids, embedding, context, width, top_k, num_results, normalize,
                        temperature, bool(request.return_items), timeout,
                        None if seed is None else int(seed), prefix_len, exclude_items,
                        item_types, exclude_history)


def _filters(request: RecRequest, limits: SearchLimits, tokenizer: Any,
             ) -> tuple[np.ndarray | None, tuple[str, ...] | None, bool]:
    """The request's filters checked: excluded ids as a sorted int64 array, the type
    allow-list as a sorted tuple, exclude_history as a bool. Filters restrict a catalog,
    so each needs a constrained engine; which types the catalog holds is checked when the
    batch runs, on the batch's own catalog."""
    given = [name for name in ("exclude_items", "item_types") if getattr(request, name) is not None]
    if not isinstance(request.exclude_history, (bool, np.bool_)):
        raise InvalidArgument(f"exclude_history: got {request.exclude_history!r}, expected "
                              "true or false")
    if request.exclude_history:
        if limits.accepts_embeddings or tokenizer is None:
            raise InvalidArgument("exclude_history: needs a decoder-only model with a tokenizer "
                                  "(its prompt names items by their semantic IDs)")
        given.append("exclude_history")
    if given and not limits.is_constrained:
        raise InvalidArgument(f"{given[0]}: filters restrict the catalog's items, and this engine "
                              "serves without a catalog (unconstrained)")
    exclude = None
    if request.exclude_items is not None:
        exclude = _item_ids(request.exclude_items, limits.max_exclude_items)
    types = None
    if request.item_types is not None:
        values = request.item_types
        if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)) or \
                not all(isinstance(v, str) for v in values):
            raise InvalidArgument(f"item_types: got {_short(values)}, expected a list of strings")
        if len(values) == 0:
            raise InvalidArgument("item_types: an empty allow-list allows no item; omit "
                                  "item_types to allow every type")
        types = tuple(sorted(set(values)))
    return exclude, types, bool(request.exclude_history)


def _item_ids(values: Any, max_items: int) -> np.ndarray:
    """`exclude_items` as sorted unique int64 ids: integers in [-2**63, 2**63), the range of a
    catalog's item ids, at most `max_items`."""
    if isinstance(values, (str, bytes)):
        raise InvalidArgument(f"exclude_items: got {_short(values)}, expected a list of item ids")
    array = _integer_list(values, "exclude_items", "integer item ids")
    if len(array) > max_items:
        raise InvalidArgument(f"exclude_items: {len(array)} ids, more than max_exclude_items="
                              f"{max_items}")
    bad = np.flatnonzero((array < np.iinfo(np.int64).min) | (array > np.iinfo(np.int64).max))
    if bad.size:
        raise InvalidArgument(f"exclude_items[{bad[0]}]: got {array[bad[0]]}, expected an item id "
                              f"in [-2**63, 2**63 - 1] (int64)")
    return np.unique(array.astype(np.int64))


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:   # an int of over 4,300 digits has no repr
        text = f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 80 else text[:77] + "..."


def _prompt_ids(request: RecRequest, field_name: str, limits: SearchLimits,
                tokenizer: Any) -> np.ndarray:
    """The request's ids (`token_ids`, or the tokenized `prompt` / `messages`), with the
    engine's generation prefix appended."""
    if field_name == "token_ids":
        ids = _token_ids(request.token_ids, limits)
    else:
        if tokenizer is None:
            raise InvalidArgument(f"{field_name}: this model directory has no tokenizer.json; "
                                  "give token_ids")
        is_prompt = field_name == "prompt"
        text = request.prompt if is_prompt else tokenizer.render_chat(request.messages)
        check_prompt_bound(field_name, text, limits, tokenizer)
        ids = _token_ids(tokenizer.encode(text, add_special_tokens=is_prompt, field=field_name),
                         limits, field_name)
    if len(ids) == 0:
        raise InvalidArgument(f"{field_name}: empty input; at least one position is required")
    if limits.generation_prefix:
        ids = np.concatenate([ids, np.asarray(limits.generation_prefix, dtype=np.int64)])
    return ids


def check_prompt_bound(field: str, text: Any, limits: SearchLimits, tokenizer: Any) -> None:
    """Refuse a prompt's text (`field`: "prompt", or "messages" for a rendered chat) that
    cannot fit `max_input_len`, before the BPE work, whose exact count decides what passes:
    it has at least `tokenizer.min_num_tokens(text)` tokens. BPE on a prompt near a megabyte
    takes most of a second (on the server's event loop, or the caller's in
    `recommend_async`); a chat is rendered for this, since its template adds text to every
    message (rendering costs a sixteenth of the BPE: 33 ms for 30,000 empty messages)."""
    if not isinstance(text, str) or tokenizer.max_token_chars is None:
        return
    prefix_len = len(limits.generation_prefix)
    if len(text) <= (limits.max_input_len - prefix_len) * tokenizer.max_token_chars:
        return   # it may fit
    num_tokens = tokenizer.min_num_tokens(text, field) + prefix_len
    if num_tokens > limits.max_input_len:
        raise InvalidArgument(
            f"{field}: at least {num_tokens} positions"
            f"{' (with the generation prefix)' if prefix_len else ''}, more than "
            f"max_input_len={limits.max_input_len} ({len(text)} characters, no token longer "
            f"than {tokenizer.max_token_chars})")


def _is_real(value: Any) -> bool:
    """A real number, numpy scalars included (np.float32 is no `float`); not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _finite(value: Any) -> float | None:
    """`value` as a finite float, or None for anything else: not a real number, NaN, infinite,
    or an int too large for a float (math.isfinite(10**400) raises OverflowError)."""
    if not _is_real(value):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _int(name: str, value: Any, default: int, low: int, high: int) -> int:
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{name}: got {_short(value)}, expected an integer")
    if not low <= value <= high:
        raise InvalidArgument(f"{name}: got {_short(value)}, allowed range [{low}, {high}]")
    return int(value)


def _integer_list(values: Any, name: str, what: str = "integers") -> np.ndarray:
    """`values` as a flat integer array (`_integers`), or `InvalidArgument` naming `name`."""
    try:
        array = _integers(values)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{name}: not a list of integers ({e})") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iuO"):
        raise InvalidArgument(f"{name}: expected a flat list of {what}, got an array of "
                              f"shape {list(array.shape)} and type {array.dtype}")
    if isinstance(values, (list, tuple)) and array.dtype.kind in "iu":   # numpy reads True as 1
        kinds = set(map(type, values))
        if bool in kinds or np.bool_ in kinds:
            index = next(i for i, v in enumerate(values) if isinstance(v, (bool, np.bool_)))
            raise InvalidArgument(f"{name}[{index}]: got {values[index]!r}, expected an "
                                  "integer, not a boolean")
    return array


def _token_ids(values: Any, limits: SearchLimits, name: str = "token_ids") -> np.ndarray:
    array = _integer_list(values, name)
    # checked before the cast to int64: 2**63 must not wrap to -2**63 in the message
    bad = np.flatnonzero((array < 0) | (array >= limits.vocab_size))
    if bad.size:
        what = f"{name}[{bad[0]}]" if name == "token_ids" else f"{name}: token {bad[0]} of the encoding"
        raise InvalidArgument(f"{what}: got {array[bad[0]]}, allowed range "
                              f"[0, {limits.vocab_size - 1}] (vocab_size={limits.vocab_size})")
    return array.astype(np.int64)


def _integers(values: Any) -> np.ndarray:
    """`values` as an array; a list of Python ints beyond int64 (which numpy turns into
    uint64, float64 or object) as an object array of those ints, compared exactly."""
    array = np.asarray(values)
    is_float_list = array.dtype.kind == "f" and not isinstance(values, np.ndarray)
    if array.ndim == 1 and (array.dtype.kind == "O" or is_float_list):
        # object arrays too: comparisons and the int64 cast would take 5.7 or True as ids
        exact = np.asarray(values, dtype=object)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
               for v in exact):
            return exact                 # (from a list: an error path, some int is too wide)
        if array.dtype.kind == "O":
            raise TypeError("not every element is an integer")
    return array


def _matrix(name: str, values: Any, width: int) -> np.ndarray:
    try:
        array = values if isinstance(values, np.ndarray) else np.asarray(values)
        if array.dtype.kind not in "iuf":   # complex (the imaginary part would be lost), text, bool
            raise TypeError(f"elements of type {array.dtype}, expected real numbers")
        with np.errstate(over="ignore", invalid="ignore"):   # beyond float32 range -> inf, refused below
            array = array.astype(np.float32, copy=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{name}: not a numeric matrix ({e})") from None
    if array.ndim != 2 or array.shape[1] != width:
        raise InvalidArgument(f"{name}: got shape {list(array.shape)}, expected [length, {width}] "
                              f"(d_model={width})")
    finite = np.isfinite(array)
    if not finite.all():
        row, col = np.argwhere(~finite)[0]
        raise InvalidArgument(f"{name}[{row}][{col}]: got {array[row, col]} as float32; NaN, Inf and "
                              f"values beyond the float32 range are not allowed")
    # a copy: the request is queued, and a caller may reuse its buffer once submit returns
    return np.array(array, order="C", copy=True)
