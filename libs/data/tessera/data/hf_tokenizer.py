"""Hugging Face `tokenizer.json` (byte-level BPE, as Llama 3, Qwen2/3, DeepSeek-V3 ship) read as
tiktoken ranks, split patterns and special tokens.

HF's BPE merges, within a pre-tokenized word, the adjacent pair of earliest merge (leftmost on
ties); tiktoken merges the adjacent pair whose concatenation has the lowest rank, and emits ranks
as ids. With rank = id the two agree exactly when, as checked here:
- every token kept as a rank is *reachable*: HF's BPE on the token's own bytes yields that one
  token. The last merge of that run is the token's *canonical* merge. Inside any word, HF's parts
  over a span evolve as HF's run on that span alone, so a pair of parts whose concatenation is
  a kept token is always its canonical pair: both sides see the same candidate pairs, and a
  token HF never builds is not offered to tiktoken;
- ids rise with canonical merge order, so both pick the same pair (ties: the same pair, leftmost).
Unreachable vocab tokens stay decodable but are not ranks. With `ignore_merges` HF emits a
whole word found in the vocab directly, as tiktoken does for a rank; an unreachable token is
then kept as a rank when HF's run on its bytes ends in 3+ parts (no pair of parts ever
concatenates to it) and none of its bytes is dropped, otherwise the file is refused.
Byte-level characters missing from the vocab are dropped by HF (no unk token): their bytes are
reported in `dropped_bytes` and removed per word by the caller.

Writing (`hf_tokenizer_files`) is the converse: ids are the ranks and each token's one merge is
the last merge of tiktoken's BPE on the token's own bytes. By the span argument above, applied to
tiktoken, two adjacent parts that concatenate to a rank are always that rank's last-merge pair,
so HF with these merges takes tiktoken's steps; tokens that BPE never builds (tiktoken emits
them only for a whole piece) get no merge and `ignore_merges`.

Added (special) tokens: `tokenizers` ignores the ids a tokenizer.json states for them and numbers
them itself (`added_token_id`). Reading, a stated id it would not give is refused; writing, the
specials go into the vocab at their ids unless that numbering already gives them their ids.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import regex

from tessera.data.added_tokens import DEFAULT_MATCH, TokenMatch

if TYPE_CHECKING:
    from tessera.data.sentencepiece_tokenizer import SentencePieceTokenizer
    from tessera.data.tokenizer import Tokenizer

# The split HF's ByteLevel pre-tokenizer applies when use_regex is true (GPT-2's pattern).
GPT2_SPLIT_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Tokens tokenizer_config.json may name, in the order transformers adds them (after added_tokens_decoder's).
_CONFIG_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_BOS_LIKE = re.compile(r"begin.of.(text|sentence)|startoftext|^<s>$|^<bos>$", re.IGNORECASE)
_EOS_LIKE = re.compile(r"end.of.(text|sentence)|endoftext|^</s>$|^<eos>$", re.IGNORECASE)
_NO_MERGE = (math.inf, -1)  # sorts after every (merge index, id)
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}
_MIN_ID_LIMIT = 1 << 16  # ids below it are always allowed (check_id_range)


def byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character HF writes for each byte 0..255. Printable
    Latin-1 bytes stand for themselves; the other 68 take U+0100 onwards, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


# str.translate table: alphabet character -> its byte; other Latin-1 characters -> U+0100, so
# that encoding the result as Latin-1 fails exactly for keys that are not byte-level text.
_TO_BYTES = {ord(c): b for b, c in enumerate(byte_level_chars())}
_TO_BYTES.update({c: 0x100 for c in range(0x100) if c not in _TO_BYTES})
_TO_CHARS = dict(enumerate(byte_level_chars()))  # byte (as a Latin-1 character) -> alphabet character


@dataclass(frozen=True)
class HFTokenizer:
    """What `Tokenizer` needs from a tokenizer.json (+ tokenizer_config.json, config.json)."""

    name: str
    ranks: dict[bytes, int]  # tokens the BPE can emit -> id (tiktoken's mergeable ranks)
    patterns: tuple[str, ...]  # split regexes, applied in turn, each piece split by the next
    special_tokens: dict[str, int]
    bos_id: int
    eos_id: int
    nfc: bool  # NFC normalizer
    dropped_bytes: bytes  # bytes without a token: HF drops them
    decode_only: dict[int, bytes]  # other ids (unreachable vocab tokens): decoded, never emitted
    matching: dict[str, TokenMatch]  # how special tokens are found in text (added_tokens' flags)


def read_hf_tokenizer(path: str | os.PathLike, doc: dict | None = None) -> HFTokenizer:
    """Convert `path` (a byte-level tokenizer.json; `doc`: its content, when already read); errors
    are one ValueError line naming the file."""
    path = os.fspath(path)
    doc = read_json(path) if doc is None else doc
    model = doc.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{path}: no 'model' object; not a Hugging Face tokenizer.json")
    _check_model(model, path)
    nfc = _is_nfc(doc.get("normalizer"), path)
    patterns = _split_patterns(doc.get("pre_tokenizer"), path)

    vocab, merges = _vocab_and_merges(model, path)
    token_bytes = {key: _key_bytes(key) for key in vocab}
    added = _added_tokens(doc, path)
    check_id_range(path, {*vocab.values(), *(t["id"] for t in added)})
    special_tokens = _added_ids(added, vocab, path)
    named, config_matching = resolve_config_tokens(path, special_tokens, vocab)
    _check_shared_ids(special_tokens, vocab, path)
    singles = {token_bytes[key][0]: i for key, i in vocab.items() if len(key) == 1 and token_bytes[key]}
    dropped = bytes(b for b in range(256) if b not in singles)
    if dropped and model.get("unk_token"):
        raise ValueError(f"{path}: bytes without a token and an unk_token: unknown-token mapping is not supported")
    ranks, decode_only = _ranks(vocab, merges, token_bytes, singles, bool(model.get("ignore_merges")), path)

    flags = [field.name for field in dataclasses.fields(TokenMatch)]  # named as in added_tokens
    matching = {t["content"]: TokenMatch(**{flag: bool(t.get(flag)) for flag in flags}) for t in added}
    matching.update(config_matching)
    bos_id, eos_id = bos_eos(path, special_tokens, named, {*ranks.values(), *decode_only})
    return HFTokenizer(tokenizer_name(path), ranks, patterns, special_tokens, bos_id, eos_id, nfc, dropped, decode_only,
                       matching)


def tokenizer_name(path: str) -> str:
    """The name "<folder>/<file>": which model folder a tokenizer came from."""
    return f"{os.path.basename(os.path.dirname(os.path.abspath(path)))}/{os.path.basename(path)}"


def _ranks(vocab: dict[str, int], merges: dict, token_bytes: dict[str, bytes | None], singles: dict[int, int],
           ignore_merges: bool, path: str) -> tuple[dict[bytes, int], dict[int, bytes]]:
    """tiktoken's ranks (reachable tokens and, with ignore_merges, safe unreachable ones) and the
    ids only decoded; refuses what tiktoken cannot reproduce (see the module docstring)."""
    ranks = {bytes([b]): i for b, i in singles.items()}
    decode_only = {}
    canonical = []  # (canonical merge index, id) of reachable tokens
    for key, i in vocab.items():
        data = token_bytes[key]
        if data is None:  # not byte-level text: HF's decoder falls back to the UTF-8 of such keys
            decode_only[i] = key.encode("utf-8")
            continue
        if len(key) == 1:
            continue
        symbols = [singles[b] for b in data if b in singles]
        parts, last = _bpe(symbols, merges)
        if parts == [i]:
            ranks[data] = i
            canonical.append((last, i))
        elif not ignore_merges:
            decode_only[i] = data
        elif len(parts) >= 3 and len(symbols) == len(data):
            ranks[data] = i
        else:
            raise ValueError(
                f"{path}: token {key!r} (id {i}) is not built by the merges, but ignore_merges emits it "
                "for a whole word; tiktoken cannot reproduce that"
            )
    _check_order(canonical, vocab, path)
    return ranks, decode_only


def read_json(path: str, optional: bool = False) -> dict:
    if optional and not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return doc


def _json_field(value, kind: type, path: str, field: str, required: bool = False):
    """`value`, read from `field` of the JSON file `path`, if it is a `kind` (true and false are not
    integers) or, unless `required`, null (absent); otherwise one ValueError line naming both, not a
    traceback where it is used."""
    if (value is None and not required) or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    found = _JSON_TYPES.get(type(value), type(value).__name__)
    raise ValueError(f"{path}: {field} must be {_JSON_TYPES[kind]}, not {found}")


def _is_id(value) -> bool:
    """A token id: a non-negative integer, not true or false (which Python counts as 0 and 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_id_range(path: str, ids: set[int]) -> None:
    """Refuses an id of at least twice the number of tokens, or 65536 for small tokenizers: the
    model has an embedding row per id up to the highest, so one stray id (10**9) would allocate
    terabytes, while real tokenizers are dense but for small gaps (Llama 3: 128,256 tokens, ids up
    to 128,255)."""
    limit = max(2 * len(ids), _MIN_ID_LIMIT)
    if max(ids, default=0) >= limit:
        raise ValueError(f"{path}: token id {max(ids)} is beyond the {len(ids)} tokens: ids must be below {limit} "
                         f"(twice the number of tokens, at least {_MIN_ID_LIMIT}), one embedding row each")


def _check_model(model: dict, path: str) -> None:
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: model type {model.get('type')!r} is not supported (byte-level BPE only)")
    if model.get("byte_fallback"):
        raise ValueError(f"{path}: model.byte_fallback is set: a SentencePiece-style BPE, not byte-level "
                         "(load_tokenizer reads it through the tokenizers library)")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"{path}: model.{key} = {model[key]!r} is not supported")


def _steps(step, inner: str, path: str, field: str) -> list[dict]:
    """The steps of a normalizer or pre-tokenizer (`field` of the file; null: none), Sequences (their
    steps in `inner`) flattened in order; a loop, not recursion: JSON may nest deeper than Python
    recurses."""
    steps, todo = [], [(field, step, False)]
    while todo:
        field, step, required = todo.pop()
        step = _json_field(step, dict, path, field, required)
        if step is None:
            continue
        if step.get("type") == "Sequence":
            parts = _json_field(step.get(inner), list, path, f"{field}.{inner}", required=True)
            todo += [(f"{field}.{inner}[{i}]", part, True) for i, part in reversed(list(enumerate(parts)))]
        else:
            steps.append(step)
    return steps


def _is_nfc(normalizer, path: str) -> bool:
    """True for NFC, False for none; anything else changes text in ways tiktoken does not."""
    steps = _steps(normalizer, "normalizers", path, "normalizer")
    unsupported = [s.get("type") for s in steps if s.get("type") != "NFC"]
    if unsupported:
        raise ValueError(f"{path}: normalizer {unsupported[0]!r} is not supported (only none or NFC)")
    return bool(steps)


def _split_patterns(pre_tokenizer, path: str) -> tuple[str, ...]:
    """The split regexes of ByteLevel / Split(Isolated) / Sequence pre-tokenizers, in order."""
    steps = _steps(pre_tokenizer, "pretokenizers", path, "pre_tokenizer")
    if not steps or steps[-1].get("type") != "ByteLevel":
        raise ValueError(f"{path}: pre_tokenizer must end with ByteLevel (byte-level BPE only)")
    patterns = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            if step is not steps[-1]:
                raise ValueError(f"{path}: pre_tokenizer has a step after ByteLevel; not supported")
            if step.get("add_prefix_space"):
                raise ValueError(f"{path}: pre_tokenizer ByteLevel add_prefix_space=true is not supported")
            if step.get("use_regex", True):
                patterns.append(GPT2_SPLIT_PATTERN)
        elif kind == "Split":
            patterns.append(_split_regex(step, path))
        else:
            raise ValueError(f"{path}: pre_tokenizer {kind!r} is not supported (ByteLevel, Split, Sequence)")
    if not patterns:
        raise ValueError(f"{path}: pre_tokenizer has no split regex (whole text as one word); not supported")
    return tuple(patterns)


def _split_regex(step: dict, path: str) -> str:
    if step.get("behavior") != "Isolated" or step.get("invert"):
        how = f"behavior {step.get('behavior')!r}" + (", invert" if step.get("invert") else "")
        raise ValueError(f"{path}: pre_tokenizer Split with {how} is not supported (Isolated only)")
    pattern = _json_field(step.get("pattern"), dict, path, "pre_tokenizer Split pattern") or {}
    kind = "Regex" if "Regex" in pattern else "String"
    text = _json_field(pattern.get(kind), str, path, f"pre_tokenizer Split pattern.{kind}") or ""
    text = text if kind == "Regex" else regex.escape(text)
    if not text:
        raise ValueError(f"{path}: pre_tokenizer Split without a pattern")
    try:
        regex.compile(text)
    except regex.error as e:
        raise ValueError(f"{path}: pre_tokenizer Split regex {text[:60]!r} does not compile ({e})") from None
    return text


def _vocab_and_merges(model: dict, path: str) -> tuple[dict[str, int], dict[tuple[int, int], tuple[int, int]]]:
    """The vocab and HF's merge table: (left id, right id) -> (merge index, id of the result);
    a pair listed twice keeps its last index, as in HF."""
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(_is_id(i) for i in vocab.values()):
        raise ValueError(f"{path}: model.vocab must map tokens to non-negative ids")
    if len(set(vocab.values())) < len(vocab):
        twice = [i for i, n in Counter(vocab.values()).items() if n > 1]
        raise ValueError(f"{path}: model.vocab gives id {twice[0]} to more than one token")
    merges = {}
    for index, merge in enumerate(_json_field(model.get("merges"), list, path, "model.merges") or []):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise ValueError(f"{path}: merge #{index} {merge!r} is not a pair of tokens")
        ids = [vocab.get(pair[0]), vocab.get(pair[1]), vocab.get(pair[0] + pair[1])]
        if None in ids:
            raise ValueError(f"{path}: merge #{index} {merge!r} uses or makes a token not in model.vocab")
        merges[ids[0], ids[1]] = (index, ids[2])
    return vocab, merges


def _key_bytes(key: str) -> bytes | None:
    """The bytes a byte-level vocab key stands for; None if it is not byte-level text."""
    try:
        return key.translate(_TO_BYTES).encode("latin-1")
    except UnicodeEncodeError:
        return None


def _bpe(symbols: list[int], merges: dict) -> tuple[list[int], int]:
    """HF's BPE on one word: merge the adjacent pair of earliest merge, leftmost on ties, until
    none applies. Returns the parts and the index of the last merge (-1: none)."""
    symbols, last = list(symbols), -1
    pairs = [merges.get(pair, _NO_MERGE) for pair in zip(symbols, symbols[1:])]
    while pairs and (best := min(pairs)) is not _NO_MERGE:
        pos = pairs.index(best)
        last, new_id = best
        symbols[pos : pos + 2] = [new_id]
        del pairs[pos]
        if pos > 0:
            pairs[pos - 1] = merges.get((symbols[pos - 1], new_id), _NO_MERGE)
        if pos < len(pairs):
            pairs[pos] = merges.get((new_id, symbols[pos + 1]), _NO_MERGE)
    return symbols, last


def _check_order(canonical: list[tuple[int, int]], vocab: dict[str, int], path: str) -> None:
    """tiktoken ranks are the ids, so ids must rise with canonical merge order."""
    canonical.sort()
    for (merge_a, id_a), (merge_b, id_b) in zip(canonical, canonical[1:]):
        if id_b <= id_a:
            names = {i: k for k, i in vocab.items() if i in (id_a, id_b)}
            raise ValueError(
                f"{path}: token ids do not follow merge order (merge #{merge_a} makes {names[id_a]!r} = id {id_a}, "
                f"the later merge #{merge_b} makes {names[id_b]!r} = id {id_b}); tiktoken ranks cannot express this"
            )


def _added_tokens(doc: dict, path: str) -> list[dict]:
    tokens = _json_field(doc.get("added_tokens"), list, path, "added_tokens") or []
    for t in tokens:
        if not (isinstance(t, dict) and isinstance(t.get("content"), str) and _is_id(t.get("id"))):
            raise ValueError(f"{path}: added_tokens entry {str(t)[:60]!r} lacks a string content or a "
                             "non-negative integer id")
    return tokens


def added_token_id(content: str, vocab: dict[str, int], added: dict[str, int]) -> int:
    """The id `tokenizers` gives `content` when it is added (tokenizer.json's added_tokens in order,
    then transformers' tokens from tokenizer_config.json), `added` holding those added before: an
    added token's or model.vocab's id for that text, else the vocab's size (its number of entries,
    whatever their ids), or one past the highest added id once that reaches it. The ids a
    tokenizer.json states for added tokens are not read."""
    if content in added or content in vocab:
        return added.get(content, vocab.get(content))
    top = max(added.values(), default=-1)
    return top + 1 if top >= len(vocab) or not vocab else len(vocab)


def _added_ids(added: list[dict], vocab: dict[str, int], path: str) -> dict[str, int]:
    """Content -> id of the added tokens, which must be the ids `tokenizers` gives them
    (`added_token_id`): a stated id it would not give is one transformers does not use."""
    tokens: dict[str, int] = {}
    for t in added:
        content, i = t["content"], t["id"]
        if not content:  # tokenizers skips it
            continue
        given = added_token_id(content, vocab, tokens)
        if given != i:
            raise ValueError(f"{path}: added token {content!r} has id {i}, but tokenizers gives it id {given} (a "
                             "model.vocab token keeps its vocab id, others are numbered from the vocab's size up)")
        tokens[content] = i
    return tokens


def _check_shared_ids(special_tokens: dict[str, int], vocab: dict[str, int], path: str) -> None:
    """Where model.vocab's ids have gaps, the vocab's size that `tokenizers` numbers new added
    tokens from can be the id of a vocab token: that id would stand for two texts."""
    holders = {i: key for key, i in vocab.items()}
    for content, i in special_tokens.items():
        if holders.get(i, content) != content:
            raise ValueError(f"{path}: added token {content!r} gets id {i} from tokenizers, the id of token "
                             f"{holders[i]!r} in model.vocab")


def _token_text(value, origin: str, field: str) -> str | None:
    """A token tokenizer_config.json names: a string or an AddedToken object ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{origin}: {field} must be a string or an object with a 'content' string")
    return value


def config_tokens(path: str) -> tuple[dict[str, str], dict[str, TokenMatch]]:
    """The tokens the tokenizer_config.json beside `path` names: bos_token, eos_token, unk_token
    (those named), and all of them in the order transformers adds them, which decides the ids of
    new ones (added_tokens_decoder's by id, the standard keys, then extra_special_tokens, else
    additional_special_tokens), each with the flags transformers gives it (`_config_match`)."""
    origin = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    config = read_json(origin, optional=True)
    decoder, named, listed = _config_entries(config, origin)
    texts = {field: _token_text(value, origin, field) for field, value in [*decoder, *named, *listed]}
    named_texts = {texts[field] for field, _ in named}
    tokens: dict[str, TokenMatch] = {}
    for field, value in [*decoder, *named, *listed]:
        if texts[field]:  # a token already added keeps its flags
            tokens.setdefault(texts[field], _config_match(value, texts[field] in named_texts))
    return {key: texts[key] for key in _CONFIG_TOKEN_KEYS[:3] if texts[key] is not None}, tokens


def _config_entries(config: dict, origin: str) -> tuple[list, list, list]:
    """tokenizer_config.json's token entries as (field, value): added_tokens_decoder's by id, the
    named ones (the standard keys, an extra_special_tokens object's), the listed extra ones."""
    decoder = _json_field(config.get("added_tokens_decoder"), dict, origin, "added_tokens_decoder") or {}
    bad = [key for key in decoder if not (key.isascii() and key.isdigit())]
    if bad:
        raise ValueError(f"{origin}: added_tokens_decoder key {bad[0]!r} is not a token id")
    decoder = [(f"added_tokens_decoder[{key!r}]", decoder[key]) for key in sorted(decoder, key=int)]
    for field, value in decoder:
        _json_field(value, dict, origin, field, required=True)
    named = [(key, config.get(key)) for key in _CONFIG_TOKEN_KEYS]
    # transformers 5 reads additional_special_tokens where extra_special_tokens is missing or empty
    extra_key = "extra_special_tokens" if config.get("extra_special_tokens") else "additional_special_tokens"
    extra = config.get(extra_key)
    if isinstance(extra, dict):  # transformers 5's model-specific named tokens
        return decoder, named + [(f"{extra_key}[{key!r}]", value) for key, value in extra.items()], []
    extra = _json_field(extra, list, origin, extra_key) or []
    return decoder, named, [(f"{extra_key}[{i}]", value) for i, value in enumerate(extra)]


def _config_match(value, named: bool) -> TokenMatch:
    """How transformers' AddedToken for a tokenizer_config.json entry is found in text: a string is
    special (not normalized); an object has its flags, is special if it says so or is named, and
    is normalized unless it says otherwise or is special."""
    if not isinstance(value, dict):
        return DEFAULT_MATCH
    special = bool(value.get("special")) or named
    return TokenMatch(normalized=bool(value.get("normalized", not special)), lstrip=bool(value.get("lstrip")),
                      rstrip=bool(value.get("rstrip")), single_word=bool(value.get("single_word")))


def resolve_config_tokens(path: str, special_tokens: dict[str, int],
                          vocab: dict[str, int]) -> tuple[dict[str, int], dict[str, TokenMatch]]:
    """Tokens tokenizer_config.json names (`config_tokens`) become special tokens, as transformers
    adds them: an existing added token or vocab entry keeps its id, a new one takes
    `added_token_id`'s. The explicit ids of added_tokens_decoder are not used: tokenizer.json
    decides ids, as in a fast tokenizer. Returns {"bos_token": id, "eos_token": id, "unk_token": id}
    for those named, and the flags of the tokens added."""
    named, tokens = config_tokens(path)
    new = {content: how for content, how in tokens.items() if content not in special_tokens}
    for content in tokens:
        special_tokens[content] = added_token_id(content, vocab, special_tokens)
    return {key: special_tokens[content] for key, content in named.items()}, new


def bos_eos(path: str, special_tokens: dict[str, int], named: dict[str, int], known: set[int]) -> tuple[int, int]:
    """BOS and EOS of the tokenizer file `path` (`known`: its ids): `named`'s bos_token /
    eos_token (tokenizer_config.json's), else bos_token_id / eos_token_id of the config.json
    beside it (first of a list), else the first special token (by id) that reads like begin /
    end of text; without any BOS the EOS serves as both (GPT-2 and Qwen do so)."""
    model_config_path = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
    model_config = read_json(model_config_path, optional=True)
    known = {*special_tokens.values(), *known}
    found = {}
    for role, like in (("bos", _BOS_LIKE), ("eos", _EOS_LIKE)):
        token_id = named.get(f"{role}_token")
        if token_id is None:
            token_id = model_config.get(f"{role}_token_id")
            token_id = token_id[0] if isinstance(token_id, list) and token_id else token_id
            if token_id is not None and (not _is_id(token_id) or token_id not in known):
                raise ValueError(f"{model_config_path}: {role}_token_id {token_id!r} is not a token of {path}")
        if token_id is None:
            token_id = next((i for t, i in sorted(special_tokens.items(), key=lambda x: x[1]) if like.search(t)), None)
        found[role] = token_id
    if found["eos"] is None:
        raise ValueError(
            f"{path}: no end-of-text token (tokenizer_config.json eos_token, config.json eos_token_id, "
            "or a special token like <|end_of_text|>)"
        )
    return (found["bos"] if found["bos"] is not None else found["eos"]), found["eos"]


def hf_tokenizer_config(tokenizer: Tokenizer | SentencePieceTokenizer, model_max_length: int | None = None) -> dict:
    """The tokenizer_config.json that has transformers' AutoTokenizer, opening `tokenizer` as a
    tokenizer.json, give its BOS and EOS ids: without one it has neither. Raises ValueError where
    BOS or EOS is not a special token (the file names them by their text)."""
    names = {i: t for t, i in tokenizer.special_tokens.items()}
    for role, token_id in (("BOS", tokenizer.bos_id), ("EOS", tokenizer.eos_id)):
        if token_id not in names:
            raise ValueError(f"{tokenizer.name}: {role} id {token_id} is not a special token; tokenizer_config.json "
                             "names BOS and EOS by their special-token text")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": names[tokenizer.bos_id],
              "eos_token": names[tokenizer.eos_id], "clean_up_tokenization_spaces": False}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def hf_tokenizer_files(tokenizer: Tokenizer, model_max_length: int | None = None) -> dict[str, bytes]:
    """`tokenizer` as a Hugging Face tokenizer.json and tokenizer_config.json (name -> content), so
    that `tokenizers` and transformers' AutoTokenizer give its ids (special-token strings inside
    text included: its `matching` flags are written) and `read_hf_tokenizer` gives it back: same
    ranks, split patterns, specials, BOS/EOS and fingerprint. HF's `encode` with special tokens
    prepends BOS, as every training document starts with it. Raises ValueError for what the
    format cannot hold."""
    config = hf_tokenizer_config(tokenizer, model_max_length)
    names = {i: t for t, i in tokenizer.special_tokens.items()}
    bos = config["bos_token"]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, **dataclasses.asdict(tokenizer.matching.get(t, DEFAULT_MATCH)),
                          "special": True} for i, t in sorted(names.items())],
        "normalizer": {"type": "NFC"} if tokenizer.nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            *({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
              for p in tokenizer.patterns),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokenizer.bos_id], "tokens": [bos]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": _bpe_model(tokenizer),
    }
    return {name: (json.dumps(content, ensure_ascii=False, indent=2) + "\n").encode()
            for name, content in (("tokenizer.json", doc), ("tokenizer_config.json", config))}


def write_hf_tokenizer(tokenizer: Tokenizer, folder: str | os.PathLike, model_max_length: int | None = None) -> None:
    """Write `hf_tokenizer_files(tokenizer, model_max_length)` into `folder` (created if needed)."""
    os.makedirs(folder, exist_ok=True)
    for name, content in hf_tokenizer_files(tokenizer, model_max_length).items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content)


def _bpe_model(tokenizer: Tokenizer) -> dict:
    """HF's BPE model: vocab = ranks (+ ids only decoded, + special tokens where
    `_specials_in_vocab` needs them), one merge per token built by BPE."""
    ranks = tokenizer.ranks
    merges, unbuilt = [], []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            pair = _last_merge(token, ranks)
            if pair is None:
                unbuilt.append(token)
            else:  # the "a b" format: byte-level keys hold no space, and every tokenizers version reads it
                merges.append(f"{_key(pair[0])} {_key(pair[1])}")
    vocab = {_key(token): i for token, i in ranks.items()}
    ranked = set(vocab)
    for i, data in sorted(tokenizer.decode_only.items()):
        if _key(data) in vocab:
            raise ValueError(f"{tokenizer.name}: id {i} decodes to the bytes of token id {vocab[_key(data)]}; "
                             "a tokenizer.json vocab holds each token once")
        vocab[_key(data)] = i
    vocab.update(_specials_in_vocab(tokenizer, vocab))
    whole_only = sorted(i for key, i in vocab.items() if key not in ranked and _key_bytes(key) is not None)
    if unbuilt and whole_only:
        raise ValueError(f"{tokenizer.name}: token {unbuilt[0]!r} is emitted only as a whole piece (HF's "
                         f"ignore_merges), which would emit id {whole_only[0]}, a vocab entry BPE never builds, too")
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": bool(unbuilt),
            "vocab": dict(sorted(vocab.items(), key=lambda item: item[1])), "merges": merges}


def _specials_in_vocab(tokenizer: Tokenizer, vocab: dict[str, int]) -> dict[str, int]:
    """The special tokens to list in model.vocab at their ids. tokenizers ignores added_tokens' ids
    (`added_token_id`): unless its numbering gives every special its id (Llama 3's layout: right
    after the other tokens), all are listed, as HF's trainer lists them, and keep their vocab ids.
    A special whose text is the vocab key of another id would take that id: refused."""
    added: dict[str, int] = {}
    for i, token in sorted((i, t) for t, i in tokenizer.special_tokens.items()):
        if vocab.get(token, i) != i:
            raise ValueError(f"{tokenizer.name}: special token {token!r} (id {i}) is also the vocab key of id "
                             f"{vocab[token]}; tokenizers would give it that id")
        added[token] = added_token_id(token, vocab, added)
    return {} if added == tokenizer.special_tokens else dict(tokenizer.special_tokens)


def _key(data: bytes) -> str:
    """The byte-level vocab key of `data` (the inverse of `_key_bytes`)."""
    return data.decode("latin-1").translate(_TO_CHARS)


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The last pair tiktoken's BPE joins on `token`'s own bytes (lowest rank of the concatenation
    first, leftmost on ties); None when it stops short of the token."""
    parts = [token[i : i + 1] for i in range(len(token))]
    pairs = [ranks.get(a + b, math.inf) for a, b in zip(parts, parts[1:])]  # rank of each adjacent pair
    while len(parts) > 2:
        rank = min(pairs)
        if rank == math.inf:
            return None
        i = pairs.index(rank)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del pairs[i]
        if i > 0:
            pairs[i - 1] = ranks.get(parts[i - 1] + parts[i], math.inf)
        if i < len(pairs):
            pairs[i] = ranks.get(parts[i] + parts[i + 1], math.inf)
    return (parts[0], parts[1])
