"""Byte-level BPE tokenizers run by tiktoken: Llama 3 `tokenizer.model` files and Hugging Face
`tokenizer.json` files (converted by `hf_tokenizer`); `load_tokenizer` also opens SentencePiece
ones (`sentencepiece_tokenizer`).

A Llama 3 `tokenizer.model` file holds one line per mergeable token, "base64(token bytes) rank",
with ranks 0..n-1. Llama 3's 256 special tokens follow the BPE ranks (ids n..n+255). A
SentencePiece `tokenizer.model` is a binary protobuf: a file that is not ASCII text is read as one.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os
import re
import unicodedata
from importlib import resources
from typing import Iterable, Iterator

import regex
import tiktoken

from tessera.data.added_tokens import DEFAULT_MATCH, AddedTokens, TokenMatch
from tessera.data.hf_tokenizer import read_hf_tokenizer, read_json
from tessera.data.sentencepiece_tokenizer import (
    SentencePieceTokenizer,
    is_sentencepiece_json,
    read_sentencepiece_json,
    read_sentencepiece_model,
)

# Llama 3's pre-tokenisation: contractions, letter runs with one leading non-letter, numbers of at
# most three digits, punctuation runs, newlines, and whitespace.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
]
# Llama 3's order: the named tokens above, then reserved tokens 5..250 to make 256 in all.
LLAMA3_SPECIAL_TOKENS = tuple(
    _NAMED_SPECIAL_TOKENS
    + [
        f"<|reserved_special_token_{i}|>"
        for i in range(5, 5 + _NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
    ]
)

# tiktoken's regex engine overflows its stack on very long inputs and on very long runs of
# whitespace or non-whitespace, so text is cut into pieces bounded by these lengths first.
_MAX_CHUNK_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_NON_SPACE_RUNS = re.compile(r"\S+")


class Tokenizer:
    """Byte-level BPE run by tiktoken: ranks (token bytes -> id), split pattern(s), special tokens.

    `Tokenizer(ranks)` is the Llama 3 layout (Llama 3 split pattern, Llama 3's 256 special tokens
    after the ranks); the keywords describe any other (see `hf_tokenizer`): ids need not be
    contiguous, specials can sit anywhere, `patterns` split in turn (HF's Isolated split: matches
    and the text between them are pieces), `dropped_bytes` are removed from each piece. Special
    tokens inside text are found as `added_tokens` says (`matching`: the flags of those that are
    not found the default way, which is transformers' for a special token).
    """

    def __init__(
        self,
        ranks: dict[bytes, int],
        name: str = "tessera",
        *,
        patterns: tuple[str, ...] = (LLAMA3_SPLIT_PATTERN,),
        special_tokens: dict[str, int] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        nfc: bool = False,
        dropped_bytes: bytes = b"",
        decode_only: dict[int, bytes] | None = None,
        matching: dict[str, TokenMatch] | None = None,
    ):
        n = len(ranks)
        self.name = name
        self.ranks = ranks
        self.patterns = tuple(patterns)
        if special_tokens is None:
            special_tokens = {tok: n + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.special_tokens = special_tokens
        self.bos_id = special_tokens["<|begin_of_text|>"] if bos_id is None else bos_id
        self.eos_id = special_tokens["<|end_of_text|>"] if eos_id is None else eos_id
        self.nfc = nfc
        self._dropped = dropped_bytes
        special_ids = set(special_tokens.values())  # these decode as the special token's text
        self.decode_only = {i: data for i, data in (decode_only or {}).items() if i not in special_ids}
        matching = sorted((matching or {}).items())
        self.matching = {t: m for t, m in matching if m != DEFAULT_MATCH and t in special_tokens}
        self._added = AddedTokens(special_tokens, self.matching, _nfc if nfc else None)
        # Identity of the token ids, so token shards can refuse a tokenizer other than the one
        # that made them, whatever its file is called.
        self.fingerprint = _fingerprint(ranks, self.patterns, special_tokens, self.bos_id, self.eos_id, nfc,
                                        self.matching)
        self._id_bytes = _decode_table(ranks, special_tokens, self.decode_only)
        self.vocab_size = len(self._id_bytes)
        # One split pattern and every byte a rank: tiktoken splits and merges in one call.
        # Otherwise pieces are split here and each piece's bytes go to tiktoken's BPE alone.
        self._whole = len(self.patterns) == 1 and not dropped_bytes
        pattern = _with_gaps(self.patterns[0]) if self._whole else "."
        self._encoding = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        self._splits = [] if self._whole else [regex.compile(p) for p in self.patterns]

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`; special-token strings inside it become those tokens (see `matching`)."""
        ids = [self.bos_id] if bos else []
        for part in self._added.split(text):
            if isinstance(part, int):
                ids.append(part)
            else:
                self._encode_ordinary(part, ids)
        if eos:
            ids.append(self.eos_id)
        return ids

    def _encode_ordinary(self, text: str, ids: list[int]) -> None:
        for chunk in _bounded_pieces(text):
            if self._whole:
                ids.extend(self._encoding.encode_ordinary(chunk))
                continue
            for piece in _split(chunk, self._splits):
                data = piece.encode("utf-8").translate(None, self._dropped)
                if data:  # tiktoken's BPE of one piece (private API, no public equivalent)
                    ids.extend(self._encoding._encode_single_piece(data))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a list or a tensor); invalid UTF-8 becomes U+FFFD."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size or self._id_bytes[i] is None]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}) or has no token")
        return b"".join(self._id_bytes[i] for i in ids).decode("utf-8", errors="replace")


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def _fingerprint(ranks, patterns, special_tokens, bos_id, eos_id, nfc, matching) -> str:
    """16 hex digits of sha256 over the ranks in order (the Llama 3 tokenizer's value, kept since
    token shards record it), plus the layout when it is not Llama 3's for that many ranks."""
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    digest = hashlib.sha256(LLAMA3_SPLIT_PATTERN.encode())
    for token, _ in ordered:
        digest.update(len(token).to_bytes(4, "little") + token)
    layout = _layout(patterns, [i for _, i in ordered], special_tokens, bos_id, eos_id, nfc, matching)
    n = len(ranks)
    llama3 = {tok: n + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)}
    if layout != _layout((LLAMA3_SPLIT_PATTERN,), list(range(n)), llama3, n, n + 1, False, {}):
        digest.update(json.dumps(layout).encode())
    return digest.hexdigest()[:16]


def _layout(patterns, ids, special_tokens, bos_id, eos_id, nfc, matching) -> dict:
    specials = sorted((i, tok) for tok, i in special_tokens.items())
    layout = {"patterns": list(patterns), "ids": ids, "specials": specials, "bos": bos_id, "eos": eos_id, "nfc": nfc}
    if matching:  # only then: the fingerprints of tokenizers without flags stay as they were
        layout["matching"] = [[tok, *dataclasses.astuple(how)] for tok, how in matching.items()]
    return layout


def _decode_table(ranks, special_tokens, decode_only) -> list[bytes | None]:
    """id -> bytes for every id up to the highest; None for ids without a token."""
    table: list[bytes | None] = [None] * (1 + max([*ranks.values(), *special_tokens.values(), *decode_only]))
    for i, data in decode_only.items():
        table[i] = data
    for data, i in ranks.items():
        table[i] = data
    for tok, i in special_tokens.items():
        table[i] = tok.encode("utf-8")
    return table


def _with_gaps(pattern: str) -> str:
    """`pattern` plus a last alternative for a run of text it does not match: HF keeps such runs
    as pieces, tiktoken would skip them. Free for total patterns (Llama 3's, GPT-2's): it is only
    tried where `pattern` fails."""
    return f"(?:{pattern})|(?:(?!(?:{pattern}))(?s:.))+"


def _split(text: str, patterns: list) -> list[str]:
    """HF's Isolated split by each pattern in turn: matches and the text between them."""
    pieces = [text]
    for pattern in patterns:
        pieces = [p for piece in pieces for p in _isolated(piece, pattern)]
    return pieces


def _isolated(text: str, pattern) -> Iterator[str]:
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            yield text[start : match.start()]
        if match.end() > match.start():
            yield match.group()
        start = match.end()
    if start < len(text):
        yield text[start:]


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer | SentencePieceTokenizer:
    """Tokenizer from a Llama 3 or SentencePiece `tokenizer.model` file, a Hugging Face
    `tokenizer.json` (byte-level or SentencePiece-style), or a folder holding either (tokenizer.json
    preferred); None gives the bundled offline default."""
    if path is None:
        asset = resources.files("tessera.data").joinpath("assets", "tokenizer.model")
        ranks = _parse_ranks(asset.read_text(encoding="ascii"), str(asset))
        return Tokenizer(ranks, "tessera-default")
    path, kind = tokenizer_file(path)
    if kind == "sentencepiece":
        return read_sentencepiece_model(path)
    if kind == "tiktoken":
        return Tokenizer(read_ranks(path), os.path.basename(path))
    doc = read_json(path)
    if is_sentencepiece_json(doc):
        return read_sentencepiece_json(path, doc)
    hf = read_hf_tokenizer(path, doc)
    return Tokenizer(hf.ranks, hf.name, patterns=hf.patterns, special_tokens=hf.special_tokens, bos_id=hf.bos_id,
                     eos_id=hf.eos_id, nfc=hf.nfc, dropped_bytes=hf.dropped_bytes, decode_only=hf.decode_only,
                     matching=hf.matching)


def tokenizer_file(path: str | os.PathLike) -> tuple[str, str]:
    """The file `load_tokenizer(path)` reads (a folder's tokenizer.json, else its tokenizer.model)
    and its format: "tokenizer.json" (by name), else by content "tiktoken" (Llama 3's ASCII
    lines) or "sentencepiece" (any other bytes: a SentencePiece protobuf, or a bad file)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        found = [os.path.join(path, n) for n in ("tokenizer.json", "tokenizer.model")]
        found = [f for f in found if os.path.isfile(f)]
        if not found:
            raise ValueError(f"{path}: folder holds no tokenizer.json or tokenizer.model")
        path = found[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    if path.endswith(".json"):
        return path, "tokenizer.json"
    with open(path, "rb") as f:
        return path, "tiktoken" if f.read().isascii() else "sentencepiece"


def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Token bytes -> rank from a `tokenizer.model` file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not a tokenizer.model file (non-ASCII byte)") from None
    return _parse_ranks(text, os.fspath(path))


def _parse_ranks(text: str, origin: str) -> dict[bytes, int]:
    """Parse `tokenizer.model` text; errors name `origin` and the line."""
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not (fields[1].isascii() and fields[1].isdigit()):
            raise ValueError(
                f"{origin}:{lineno}: expected '<base64 token> <rank>', got {line[:60]!r}"
            )
        try:
            token = base64.b64decode(fields[0], validate=True)
        except binascii.Error:
            bad = fields[0][:60]
            raise ValueError(f"{origin}:{lineno}: invalid base64 token {bad!r}") from None
        rank = int(fields[1])
        if token in ranks:
            raise ValueError(f"{origin}:{lineno}: token {token!r} appears twice")
        if rank in seen_ranks:
            raise ValueError(f"{origin}:{lineno}: rank {rank} appears twice")
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise ValueError(f"{origin}: no token ranks found")
    if len(seen_ranks) != max(seen_ranks) + 1:
        missing = min(set(range(len(seen_ranks))) - seen_ranks)
        raise ValueError(f"{origin}: ranks must be 0..n-1 without gaps; rank {missing} is missing")
    for b in range(256):
        if bytes([b]) not in ranks:
            raise ValueError(f"{origin}: byte 0x{b:02x} has no rank; every single byte needs one")
    return ranks


def write_ranks(ranks: dict[bytes, int], path: str | os.PathLike) -> None:
    """Write `ranks` as a `tokenizer.model` file, one "base64 rank" line per token in rank order."""
    lines = [
        f"{base64.b64encode(token).decode('ascii')} {rank}\n"
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.writelines(lines)


def _bounded_pieces(text: str) -> Iterator[str]:
    """Cut `text` into pieces tiktoken can take (see _MAX_CHUNK_CHARS, _MAX_RUN_CHARS)."""
    for start in range(0, len(text), _MAX_CHUNK_CHARS):
        chunk = text[start : start + _MAX_CHUNK_CHARS]
        if len(chunk) <= _MAX_RUN_CHARS or not _has_long_run(chunk):
            yield chunk
        else:
            yield from _cut_long_runs(chunk)


def _has_long_run(text: str) -> bool:
    # Both scans are linear and run in C; the per-character cut below is only for rare inputs.
    longest_word = max(map(len, text.split()), default=0)
    longest_space = max(map(len, _NON_SPACE_RUNS.split(text)), default=0)
    return max(longest_word, longest_space) > _MAX_RUN_CHARS


def _cut_long_runs(text: str) -> Iterator[str]:
    piece_start = 0
    run_length = 0
    run_is_space = None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        run_length = run_length + 1 if is_space == run_is_space else 1
        run_is_space = is_space
        if run_length > _MAX_RUN_CHARS:
            yield text[piece_start:i]
            piece_start = i
            run_length = 1
    yield text[piece_start:]
