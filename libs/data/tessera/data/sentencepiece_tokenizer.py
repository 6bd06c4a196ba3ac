"""SentencePiece tokenizers (Llama 2, Mistral, Gemma, T5 style), run by the libraries that define
them: a SentencePiece-style `tokenizer.json` by Hugging Face `tokenizers`, a SentencePiece
`tokenizer.model` (protobuf) by `sentencepiece`. Both libraries are optional; a file that needs
one says which to install.

Why not tiktoken, as for byte-level files: these vocabularies hold pieces of normalized text
("▁the", with byte fallback to <0x..> tokens for characters they lack) rather than byte strings,
spaces become "▁" with a prefix before the text, and a Unigram model searches for the most likely
segmentation instead of merging pairs. The libraries give transformers' ids by construction.

Special tokens inside text follow transformers: `tokenizers` finds a tokenizer.json's added tokens
itself, with their flags, after the tokens tokenizer_config.json names are added as transformers
adds them. For a tokenizer.model, its special pieces (<s>, </s>, <unk>) are cut out of
the text here and the text between them is encoded as a text of its own, as transformers' legacy
Llama tokenizer and Llama 2's tokenizer.json do (SentencePiece finds its user-defined pieces
itself).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
import json
from typing import Callable, Iterable

from tessera.data.added_tokens import AddedTokens
from tessera.data.hf_tokenizer import bos_eos, check_id_range, config_tokens, resolve_config_tokens, tokenizer_name


class SentencePieceTokenizer:
    """A library's tokenizer behind the interface of `Tokenizer` that the data pipeline uses:
    encode, decode, vocab_size (highest id + 1), bos_id, eos_id, special_tokens, name, fingerprint."""

    def __init__(self, name: str, fingerprint: str, encode_text: Callable[[str], list[int]],
                 decode_ids: Callable[[list[int]], str], ids: set[int], special_tokens: dict[str, int],
                 bos_id: int, eos_id: int):
        self.name, self.fingerprint = name, fingerprint
        self.special_tokens, self.bos_id, self.eos_id = special_tokens, bos_id, eos_id
        self.vocab_size = max(ids) + 1
        self._encode, self._decode, self._ids = encode_text, decode_ids, ids

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`; special-token strings inside it become those tokens."""
        return [*([self.bos_id] if bos else []), *self._encode(text), *([self.eos_id] if eos else [])]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a list or a tensor), as the library decodes it; invalid UTF-8 becomes U+FFFD."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [i for i in ids if i not in self._ids]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}) or has no token")
        return self._decode(ids)


def is_sentencepiece_json(doc: dict) -> bool:
    """Whether a tokenizer.json is SentencePiece's kind: a Unigram model, a BPE with byte fallback,
    or text marked with "▁" (a Metaspace pre-tokenizer, a Prepend normalizer)."""
    model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    return (model.get("type") == "Unigram" or bool(model.get("byte_fallback"))
            or "Metaspace" in _step_types(doc.get("pre_tokenizer"), "pretokenizers")
            or "Prepend" in _step_types(doc.get("normalizer"), "normalizers"))


def _step_types(step, inner: str) -> set:
    """The types of a pre-tokenizer or normalizer and of the steps of its Sequences. Malformed parts
    are skipped here (the reader the file goes to names them); a loop, as in hf_tokenizer._steps."""
    types, todo = set(), [step]
    while todo:
        step = todo.pop()
        if isinstance(step, dict):
            types.add(step.get("type") if isinstance(step.get("type"), str) else None)
            todo += step.get(inner) if isinstance(step.get(inner), list) else []
    return types


def read_sentencepiece_json(path: str, doc: dict) -> SentencePieceTokenizer:
    """A SentencePiece-style tokenizer.json (`doc`: its content) run by `tokenizers`, with
    transformers' setup: no truncation or padding, tokenizer_config.json's tokens added."""
    tokenizers = _library("tokenizers", path, "a SentencePiece-style tokenizer.json")
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own exception type for any bad content
        raise ValueError(f"{path}: tokenizers cannot read it ({_first_line(e)})") from None
    tok.no_truncation()
    tok.no_padding()
    named, tokens = config_tokens(path)
    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    tok.add_special_tokens([tokenizers.AddedToken(n, special=True, **dataclasses.asdict(how))
                            for n, how in tokens.items() if n not in present])
    special_tokens = {t.content: i for i, t in sorted(tok.get_added_tokens_decoder().items())}
    named = {key: tok.token_to_id(n) for key, n in named.items()}
    ids = set(tok.get_vocab(with_added_tokens=True).values())
    check_id_range(path, ids)
    bos_id, eos_id = bos_eos(path, special_tokens, named, ids)
    identity = json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()
    return SentencePieceTokenizer(
        tokenizer_name(path), _fingerprint(b"tokenizers", identity, special_tokens, bos_id, eos_id),
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        lambda ids: tok.decode(ids, skip_special_tokens=False), ids, special_tokens, bos_id, eos_id)


def read_sentencepiece_model(path: str) -> SentencePieceTokenizer:
    """A SentencePiece `tokenizer.model` run by `sentencepiece`; special tokens are, as in
    transformers, its control pieces, the tokens tokenizer_config.json names (new ones after the
    pieces) and, unless that names another unk_token, its unknown piece. BOS/EOS as for a
    tokenizer.json, the model's own bos/eos pieces ranking after tokenizer_config.json."""
    spm = _library("sentencepiece", path, "a SentencePiece tokenizer.model (not Llama 3's ASCII format)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        sp = spm.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, OSError) as e:
        raise ValueError(f"{path}: not a tokenizer.model file: neither ASCII (Llama 3's format) nor a "
                         f"SentencePiece model ({_first_line(e)})") from None
    pieces = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    special_tokens = {p: i for p, i in pieces.items() if sp.is_control(i)}
    named, _ = resolve_config_tokens(path, special_tokens, pieces)
    if "unk_token" not in named and sp.unk_id() >= 0:
        special_tokens[sp.id_to_piece(sp.unk_id())] = sp.unk_id()
    for key, own in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id())):
        if own >= 0:
            named.setdefault(key, own)
    ids = {*pieces.values(), *special_tokens.values()}
    bos_id, eos_id = bos_eos(path, special_tokens, named, ids)
    added = AddedTokens(special_tokens, {})
    names = {i: t for t, i in special_tokens.items()}

    def encode_text(text: str) -> list[int]:
        parts = added.split(text)
        return [i for part in parts for i in ([part] if isinstance(part, int) else sp.encode(part))]

    def decode_ids(ids: list[int]) -> str:  # runs between special tokens, each as SentencePiece decodes it
        runs = itertools.groupby(ids, key=names.__contains__)
        return "".join("".join(names[i] for i in run) if special else sp.decode(list(run)) for special, run in runs)

    fingerprint = _fingerprint(b"sentencepiece", data, special_tokens, bos_id, eos_id)
    return SentencePieceTokenizer(tokenizer_name(path), fingerprint, encode_text, decode_ids, ids, special_tokens,
                                  bos_id, eos_id)


def _first_line(error: Exception) -> str:
    """A library's message, cut to one line: errors here are one line naming the file."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200].strip()


def _library(module: str, path: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{path}: reading {what} needs {module}: pip install {module}") from None


def _fingerprint(kind: bytes, identity: bytes, special_tokens: dict[str, int], bos_id: int, eos_id: int) -> str:
    """16 hex digits of sha256 over what decides the ids: the library, the tokenizer's content,
    its special tokens and BOS/EOS."""
    digest = hashlib.sha256(kind + b"\0" + identity)
    digest.update(json.dumps([sorted((i, t) for t, i in special_tokens.items()), bos_id, eos_id]).encode())
    return digest.hexdigest()[:16]
