import base64
import random
import re
from pathlib import Path

import pytest
import tiktoken
import torch

from tessera.data import (
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SPLIT_PATTERN,
    load_tokenizer,
    read_ranks,
    write_ranks,
)
import tessera.data
from tessera.data.tokenizer import _MAX_RUN_CHARS

DEFAULT_MODEL = Path(tessera.data.__file__).parent / "assets" / "tokenizer.model"

SAMPLES = [
    "",
    "hello world",
    "def f(x):\n\treturn x ** 2  # square\r\n",
    "emoji 👋🏽👨‍👩‍👧‍👦 🇯🇵 and CJK 世界你好 日本語のテキスト 한국어",
    "combining e\u0301 a\u0308\u0323 Z\u0351\u0360\u0489 and NFC é",
    "control \x00\x01\x07\x1b[0m\x7f\x85 \u2028\u2029 \ufeff zero\u200bwidth",
    "right-to-left עברית العربية and math ∑∫√∞ ≤ ≥",
    "numbers 1234567890 3.14159 1e-10 0xFF",
    "contractions I'm you're we've they'll she'd it's DON'T",
    "   leading and trailing spaces   \n\n\n  ",
    "<|begin_of_text|> special-token text <|eot_id|>, <|eot_id |> <|reserved_special_token_250|><|eot_id|>",
    bytes(range(256)).decode("utf-8", errors="replace"),
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_default_tokenizer_vocab(tok):
    assert tok.vocab_size == 2048
    assert (tok.bos_id, tok.eos_id) == (1792, 1793)
    assert tok.special_tokens["<|eot_id|>"] == 1792 + 9


def test_llama3_special_tokens_order():
    assert len(LLAMA3_SPECIAL_TOKENS) == len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    assert LLAMA3_SPECIAL_TOKENS[:10] == (
        "<|begin_of_text|>", "<|end_of_text|>",
        "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
        "<|start_header_id|>", "<|end_header_id|>",
        "<|reserved_special_token_4|>", "<|eot_id|>",
    )
    assert LLAMA3_SPECIAL_TOKENS[10] == "<|reserved_special_token_5|>"
    assert LLAMA3_SPECIAL_TOKENS[-1] == "<|reserved_special_token_250|>"


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text, bos=False, eos=False)
    # special-token text becomes those tokens (transformers' default), the rest stays in the ranks
    found = re.findall("|".join(map(re.escape, LLAMA3_SPECIAL_TOKENS)), text)
    assert [i for i in ids if i >= tok.bos_id] == [tok.special_tokens[t] for t in found]
    assert tok.decode(ids) == text


def test_round_trip_random_bytes_and_code_points(tok):
    rng = random.Random(0)
    for _ in range(50):
        text = bytes(rng.randrange(256) for _ in range(200)).decode("utf-8", errors="replace")
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text
        # Any code point except lone surrogates, which UTF-8 cannot carry.
        points = (rng.randrange(0x110000) for _ in range(100))
        text = "".join(chr(p) for p in points if not 0xD800 <= p < 0xE000)
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_bos_eos_and_tensor_decode(tok):
    ids = tok.encode("hi", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(torch.tensor(ids)) == "<|begin_of_text|>hi<|end_of_text|>"
    with pytest.raises(ValueError, match="token id 2048 is outside"):
        tok.decode([5, 2048])


def test_very_long_runs_round_trip(tok):
    # One run much longer than tiktoken's regex can take in one piece.
    text = "x" + " " * (4 * _MAX_RUN_CHARS) + "=" * (3 * _MAX_RUN_CHARS) + "y\n"
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_llama3_format_file_matches_tiktoken(tok, tmp_path):
    # A prefix of BPE ranks is itself a valid rank table: 256 bytes + 144 merges.
    ranks = {t: r for t, r in read_ranks(DEFAULT_MODEL).items() if r < 400}
    path = tmp_path / "tokenizer.model"
    write_ranks(ranks, path)
    mine = load_tokenizer(path)
    specials = {t: 400 + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
    reference = tiktoken.Encoding(
        "reference", pat_str=LLAMA3_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    assert mine.vocab_size == 400 + 256
    assert (mine.bos_id, mine.eos_id) == (400, 401)
    for text in SAMPLES:  # tiktoken's own special-token matching as the reference
        assert mine.encode(text, bos=False, eos=False) == reference.encode(text, allowed_special="all")
        assert mine.encode(text, bos=True, eos=True) == [400, *reference.encode(text, allowed_special="all"), 401]


def _write_lines(tmp_path, lines):
    path = tmp_path / "bad.model"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _byte_lines(skip=None):
    return [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256) if b != skip]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file not found: .*nope.model"):
        load_tokenizer(tmp_path / "nope.model")


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], r"bad.model: no token ranks"),
        (_byte_lines() + ["QUJD"], r"bad.model:257: expected '<base64 token> <rank>'"),
        (_byte_lines() + ["QUJD x"], r"bad.model:257: expected"),
        (_byte_lines() + ["QU*D 256"], r"bad.model:257: invalid base64 token"),
        (_byte_lines() + ["QQ== 256"], r"bad.model:257: token b'A' appears twice"),
        (_byte_lines() + ["QUI= 255"], r"bad.model:257: rank 255 appears twice"),
        (_byte_lines() + ["QUI= 300"], r"bad.model: ranks must be 0..n-1 without gaps; rank 256"),
        (_byte_lines(skip=7) + ["QUI= 7"], r"bad.model: byte 0x07 has no rank"),
    ],
)
def test_malformed_file(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        load_tokenizer(_write_lines(tmp_path, lines))


def test_non_ascii_file(tmp_path):
    path = tmp_path / "bad.model"
    path.write_bytes(b"QQ== 0\n\xff\xfe 1\n")
    with pytest.raises(ValueError, match=r"bad.model:2: not a tokenizer.model file"):
        read_ranks(path)
    # load_tokenizer takes non-ASCII bytes for a SentencePiece model (tests/test_sentencepiece_tokenizer.py)
