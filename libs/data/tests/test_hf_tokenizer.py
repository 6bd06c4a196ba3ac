"""Hugging Face tokenizer.json files through tiktoken, read and written: ids against a naive
implementation of HF's byte-level BPE written here and, for token ids, against `tokenizers` and
transformers' AutoTokenizer themselves; round trips, BOS/EOS rules and one-line errors. Every
tokenizer.json is written by the library from the default ranks (in other layouts, some edited as
other producers write them) or trained here by `tokenizers`."""

import json
import random
import unicodedata
from pathlib import Path

import pytest
import regex
import tokenizers

import tessera.data
from tessera.data import Tokenizer, hf_tokenizer_files, load_tokenizer, read_ranks, write_hf_tokenizer
from tessera.data.hf_tokenizer import byte_level_chars
from tessera.data.tokenizer import LLAMA3_SPECIAL_TOKENS, LLAMA3_SPLIT_PATTERN, _MAX_RUN_CHARS

RANKS = read_ranks(Path(tessera.data.__file__).parent / "assets" / "tokenizer.model")
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# DeepSeek-V3's style: digits, then CJK runs, then the rest, each split refining the last; the
# last pattern matches neither digits nor control characters, so HF keeps those as gap pieces.
DIGITS, CJK = r"\p{N}{1,3}", r"[一-龥\u3040-ゟ゠-ヿ]+"
REST = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

MIXED = [
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's DON'T.",
    "def f(x):\n\treturn x ** 2  # square\r\n\n\n\t\t  \tend",
    "café naïve résumé e\u0301 a\u0308\u0323 Ångström ñandú ÆØÅ",
    "世界你好 日本語のテキスト カタカナ 한국어 中文123字",
    "emoji 👋🏽👨‍👩‍👧‍👦 🇯🇵 ❤️ 🤖",
    "numbers 1234567890123456789012345678901234567890 3.14159 1e-10 0xFF 007 2024-01-31",
    "   leading     runs of spaces   and trailing   \n\n\n   \t\t\n",
    "<|begin_of_text|> special <|end_of_text|><|eot_id|> <｜begin▁of▁sentence｜> <|endoftext|>",
    "control \x00\x01\x07\x1b[0m\x7f\x85 \u2028\u2029 \ufeff zero\u200bwidth",
    "right-to-left עברית العربية and math ∑∫√∞ ≤ ≥ ½",
]


def alphabet() -> list[str]:
    """GPT-2's byte -> character table, written out independently of the library (the oracle's)."""
    chars = {}
    for lo, hi in (("!", "~"), ("¡", "¬"), ("®", "ÿ")):
        for b in range(ord(lo), ord(hi) + 1):
            chars[b] = chr(b)
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


ALPHABET = alphabet()


def key(data: bytes) -> str:
    return "".join(ALPHABET[b] for b in data)


def all_split_merges(ranks):
    """Every split of a token into two tokens, by token rank then part ranks (Llama 3's file)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
        merges += sorted(splits, key=lambda s: (ranks[s[0]], ranks[s[1]]))
    return merges


def byte_level(use_regex):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def doc_of(tok):
    """The tokenizer.json the library writes for `tok`, as a dict to edit."""
    return json.loads(hf_tokenizer_files(tok)["tokenizer.json"])


def write(folder, doc, config=None, model_config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if model_config is not None:
        (folder / "config.json").write_text(json.dumps(model_config))
    return folder


def split_added(doc, text):
    """HF's cut of added tokens out of raw text for these files (no flags set), naively: at each
    position the longest added token that starts there, left to right."""
    added = {t["content"]: t["id"] for t in doc["added_tokens"]}
    firsts = {c[0] for c in added}
    parts, start, i = [], 0, 0
    while i < len(text):
        hit = max((c for c in added if text.startswith(c, i)), key=len, default=None) if text[i] in firsts else None
        if hit is None:
            i += 1
            continue
        parts += [text[start:i], added[hit]]
        i = start = i + len(hit)
    return [p for p in parts + [text[start:]] if p != ""]


def reference_encode(doc, text):
    """HF's pipeline for these files, naively: added tokens cut out, then each text between them:
    NFC, Isolated regex splits, bytes -> characters, unknown characters dropped, then merge the
    adjacent pair of lowest merge index (leftmost)."""
    return [i for part in split_added(doc, text)
            for i in ([part] if isinstance(part, int) else reference_encode_text(doc, part))]


def reference_encode_text(doc, text):
    model, vocab = doc["model"], doc["model"]["vocab"]
    priority = {tuple(m.split(" ") if isinstance(m, str) else m): i for i, m in enumerate(model["merges"])}
    if doc["normalizer"]:
        text = unicodedata.normalize("NFC", text)
    steps = doc["pre_tokenizer"].get("pretokenizers", [doc["pre_tokenizer"]])
    patterns = [s["pattern"]["Regex"] if s["type"] == "Split" else GPT2_PATTERN
                for s in steps if s["type"] == "Split" or s.get("use_regex")]
    pieces = [text]
    for pattern in patterns:  # a capturing split keeps both the matches and the text between
        pieces = [p for piece in pieces for p in regex.split(f"({pattern})", piece) if p]
    ids = []
    for piece in pieces:
        word = [ALPHABET[b] for b in piece.encode("utf-8")]
        if model.get("ignore_merges") and "".join(word) in vocab:
            ids.append(vocab["".join(word)])
            continue
        word = [c for c in word if c in vocab]
        while True:
            found = [(priority[w], i) for i, w in enumerate(zip(word, word[1:])) if w in priority]
            if not found:
                break
            _, i = min(found)
            word[i : i + 2] = [word[i] + word[i + 1]]
        ids += [vocab[w] for w in word]
    return ids


def texts():
    rng = random.Random(0)
    noisy = bytes(rng.randrange(256) for _ in range(300)).decode("utf-8", errors="replace")
    return MIXED + ["\n".join(MIXED), noisy]


def shifted_ids(offset):
    """Ids as an HF trainer gives them: `offset` specials first, bytes in alphabet order, merges."""
    by_char = sorted(range(256), key=lambda b: ALPHABET[b])
    ids = {bytes([b]): offset + k for k, b in enumerate(by_char)}
    ids.update({t: offset + r for t, r in RANKS.items() if r >= 256})
    return ids


def check_matches_reference(tok, doc, round_trip=True):
    for text in texts():
        ids = tok.encode(text, bos=False, eos=False)
        assert ids == reference_encode(doc, text), text
        if round_trip:
            assert tok.decode(ids) == text


def check_transformers_ids(tok, folder):
    """transformers' AutoTokenizer on `folder` has `tok`'s special tokens at their ids and gives its
    ids for text, special-token text inside included."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(folder))
    assert auto.get_added_vocab() == tok.special_tokens
    specials = " ".join(tok.special_tokens)
    for text in [*texts(), specials, f"x{specials}y"]:
        assert auto.encode(text, add_special_tokens=False) == tok.encode(text, False, False), text
    return auto


def check_rewrites(tok, folder):
    """`tok` written by the library and read back is the same tokenizer, and transformers reads the
    files with its ids, BOS and EOS (BOS prepended, as in training)."""
    write_hf_tokenizer(tok, folder)
    back = load_tokenizer(folder)
    assert (back.ranks, back.patterns, back.special_tokens, back.decode_only) == (
        tok.ranks, tok.patterns, tok.special_tokens, tok.decode_only)
    assert (back.bos_id, back.eos_id, back.nfc, back.vocab_size, back.fingerprint) == (
        tok.bos_id, tok.eos_id, tok.nfc, tok.vocab_size, tok.fingerprint)
    auto = check_transformers_ids(tok, folder)
    assert (auto.bos_token_id, auto.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert auto.encode("plain text") == tok.encode("plain text", bos=True, eos=False)
    return back


def test_alphabet_matches_the_oracle():
    assert byte_level_chars() == ALPHABET


def test_default_written_and_read_back(tmp_path):
    default = load_tokenizer()
    write_hf_tokenizer(default, tmp_path, model_max_length=4096)
    doc = json.loads((tmp_path / "tokenizer.json").read_text())
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "clean_up_tokenization_spaces": False, "model_max_length": 4096}
    assert len(doc["model"]["merges"]) == len(RANKS) - 256 and not doc["model"]["ignore_merges"]
    tok = check_rewrites(default, tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1792, 1793, 2048)
    assert tok.fingerprint == "6b80717cc6a880f8"  # shards stay valid
    check_matches_reference(tok, doc)
    for text in texts():
        assert tok.encode(text, True, True) == default.encode(text, True, True)


def shuffled_ranks():
    """The merge tokens in a random order: tiktoken then builds some tokens only through parts of
    higher rank, and some never (emitted only as a whole piece: ignore_merges)."""
    by_rank = sorted(RANKS, key=RANKS.get)
    merged = by_rank[256:]
    random.Random(1).shuffle(merged)
    return {t: i for i, t in enumerate(by_rank[:256] + merged)}


def test_ranks_built_through_later_tokens_or_never(tmp_path):
    tok = Tokenizer(shuffled_ranks(), "shuffled")
    doc = doc_of(tok)
    assert doc["model"]["ignore_merges"] and 1300 < len(doc["model"]["merges"]) < len(RANKS) - 256
    check_matches_reference(tok, doc)
    check_rewrites(tok, tmp_path)


def test_what_the_writer_refuses():
    with pytest.raises(ValueError, match=r"^t: EOS id 5 is not a special token; tokenizer_config.json names BOS"):
        hf_tokenizer_files(Tokenizer(RANKS, "t", special_tokens={"<|begin_of_text|>": 1792}, eos_id=5))
    token = sorted(RANKS, key=RANKS.get)[300]
    with pytest.raises(ValueError, match=r"^t: id 2048 decodes to the bytes of token id 300; a tokenizer.json vocab"):
        hf_tokenizer_files(Tokenizer(RANKS, "t", decode_only={2048: token}))
    with pytest.raises(ValueError, match=r"^t: token b'.+' is emitted only as a whole piece \(HF's ignore_merges\), "
                                         r"which would emit id 1792, a vocab entry BPE never builds, too$"):
        hf_tokenizer_files(Tokenizer(shuffled_ranks(), "t", decode_only={2048: b"<|pad|>"}))
    with pytest.raises(ValueError, match=r"^t: special token 'a' \(id 1794\) is also the vocab key of id 97; "
                                         r"tokenizers would give it that id$"):
        hf_tokenizer_files(Tokenizer(RANKS, "t", special_tokens={"<|begin_of_text|>": 1792, "<|end_of_text|>": 1793,
                                                                 "a": 1794}))


def test_all_split_merges_with_ignore_merges(tmp_path):
    doc = doc_of(load_tokenizer())
    doc["model"]["merges"] = [[key(a), key(b)] for a, b in all_split_merges(RANKS)]
    doc["model"]["ignore_merges"] = True
    assert len(doc["model"]["merges"]) > len(RANKS) - 256  # several merges per token
    tok = load_tokenizer(write(tmp_path / "t", doc) / "tokenizer.json")
    assert tok.ranks == RANKS
    check_matches_reference(tok, doc)


def test_gpt2_byte_level_nfc_and_specials_anywhere(tmp_path):
    ids = shifted_ids(3)
    added = {"<s>": 0, "</s>": 1, "<pad>": 2, "<|endoftext|>": 5000, "<|im_start|>": 5001}
    doc = doc_of(Tokenizer(ids, patterns=(GPT2_PATTERN,), special_tokens=added, bos_id=0, eos_id=1, nfc=True))
    doc["pre_tokenizer"] = byte_level(True)
    tok = load_tokenizer(write(tmp_path / "t", doc))  # no tokenizer_config.json
    assert tok.ranks == ids and tok.vocab_size == 5002
    assert tok.special_tokens == added and (tok.bos_id, tok.eos_id) == (0, 1)  # by their names
    assert all(doc["model"]["vocab"][t] == i for t, i in added.items())  # tokenizers ignores added_tokens' ids
    check_matches_reference(tok, doc, round_trip=False)  # NFC changes text
    assert tok.decode(tok.encode("plain ascii\n", True, True)) == "<s>plain ascii\n</s>"
    with pytest.raises(ValueError, match="token id 4000 is outside the vocabulary .* or has no token"):
        tok.decode([4000])
    check_rewrites(tok, tmp_path / "again")


def test_sequence_of_splits_deepseek_style(tmp_path):
    added = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2}
    doc = doc_of(Tokenizer(shifted_ids(3), patterns=(DIGITS, CJK, REST), special_tokens=added, bos_id=0, eos_id=1))
    doc["model"]["vocab"].update(added)  # HF's trainer lists specials in the vocab too
    config = {"bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>"},
              "eos_token": {"__type": "AddedToken", "content": "<｜end▁of▁sentence｜>"}}
    tok = load_tokenizer(write(tmp_path / "t", doc, config))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    check_matches_reference(tok, doc)
    long = "x" + " " * (2 * _MAX_RUN_CHARS) + "7" * 10
    assert tok.decode(tok.encode(long, False, False)) == long
    check_rewrites(tok, tmp_path / "again")


def test_single_split_that_leaves_gaps(tmp_path):
    # REST alone matches no digits: HF keeps digit runs as pieces, tiktoken alone would skip them.
    tok = Tokenizer(RANKS, patterns=(REST,))
    check_matches_reference(check_rewrites(tok, tmp_path), doc_of(tok))


def test_bytes_without_tokens_are_dropped(tmp_path):
    # Like torchtitan's test tokenizer: some bytes (here space, controls, 0x80-0xBF) have no token.
    dropped = bytes([*range(0x21), *range(0x7F, 0xC0)])
    ids = {t: r for t, r in RANKS.items() if not set(dropped) & set(t)}
    doc = doc_of(Tokenizer(ids, special_tokens={"<|endoftext|>": 1792}, bos_id=1792, eos_id=1792,
                           dropped_bytes=dropped))
    tok = load_tokenizer(write(tmp_path / "t", doc))  # no tokenizer_config.json
    assert tok.eos_id == tok.bos_id == 1792  # no BOS named anywhere: EOS serves as both
    check_matches_reference(tok, doc, round_trip=False)
    assert tok.decode(tok.encode("a b\tc", False, False)) == "abc"
    check_rewrites(tok, tmp_path / "again")


def _pair_whose_bytes_end(ranks, doc, parts_wanted):
    """Two tokens whose concatenation is no token and whose bytes BPE into `parts_wanted` parts
    other than the two."""
    tokens = sorted((t for t in ranks if 2 <= len(t) <= 4), key=ranks.get)[:150]
    for a in tokens:
        for b in tokens:
            text = (a + b).decode("utf-8", errors="strict") if (a + b).isascii() else None
            if text and a + b not in ranks and regex.fullmatch(LLAMA3_SPLIT_PATTERN, text):
                got = reference_encode(doc, text)
                if len(got) == parts_wanted and got != [ranks[a], ranks[b]]:
                    return a, b
    raise AssertionError("no such pair")


@pytest.mark.parametrize("parts, ignore_merges", [(2, False), (3, False), (3, True), (2, True)])
def test_tokens_the_merges_never_build(tmp_path, parts, ignore_merges):
    a, b = _pair_whose_bytes_end(RANKS, doc_of(load_tokenizer()), parts)
    # merge (a, b) is listed but HF's BPE never lines a and b up; a + b is id 1792, the specials follow
    specials = {t: 1793 + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
    doc = doc_of(Tokenizer(RANKS, special_tokens=specials, decode_only={1792: a + b}))
    doc["model"]["merges"].append([key(a), key(b)])
    doc["model"]["ignore_merges"] = ignore_merges
    folder = write(tmp_path / "t", doc)
    if parts == 2 and ignore_merges:
        with pytest.raises(ValueError, match=r"tokenizer.json: token .* is not built by the merges, but ignore_merges"):
            load_tokenizer(folder)
        return
    tok = load_tokenizer(folder)
    assert (a + b in tok.ranks) == ignore_merges and tok.decode([1792]) == (a + b).decode()
    text = " ".join(t.decode() for t in (a + b, a, b, a + b + a))
    assert tok.encode(text, False, False) == reference_encode(doc, text)
    check_matches_reference(tok, doc)


def test_ids_out_of_merge_order_are_refused(tmp_path):
    tokens = sorted(RANKS, key=RANKS.get)
    doc = doc_of(load_tokenizer())
    doc["model"]["vocab"].update({key(tokens[300]): 301, key(tokens[301]): 300})
    with pytest.raises(ValueError, match=r"tokenizer.json: token ids do not follow merge order \(merge #44 makes"):
        load_tokenizer(write(tmp_path / "t", doc))


def _small_doc():
    return doc_of(Tokenizer(RANKS, special_tokens={"<|begin_of_text|>": 1792, "<|end_of_text|>": 1793,
                                                   "<|eot_id|>": 1794}))


@pytest.mark.parametrize("config, model_config, expected", [
    ({"bos_token": "<|end_of_text|>", "eos_token": "<|eot_id|>"}, None, (1793, 1794)),
    ({"bos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False}, "eos_token": None},
     {"eos_token_id": [1793, 1794]}, (1794, 1793)),
    (None, {"bos_token_id": 1794, "eos_token_id": 1792}, (1794, 1792)),
    ({"add_bos_token": True}, None, (1792, 1793)),  # names none: by the tokens' names
])
def test_bos_eos_rules(tmp_path, config, model_config, expected):
    tok = load_tokenizer(write(tmp_path / "t", _small_doc(), config, model_config))
    assert (tok.bos_id, tok.eos_id) == expected
    ids = tok.encode("hi", bos=True, eos=True)
    assert (ids[0], ids[-1]) == expected and ids[1:-1] == tok.encode("hi", bos=False, eos=False) == [104, 105]


def test_config_tokens_missing_from_tokenizer_json_are_appended(tmp_path):
    # torchtitan's test tokenizer: BOS/EOS only in tokenizer_config.json (with ids HF ignores).
    doc = _small_doc()
    doc["added_tokens"] = []
    doc["model"]["vocab"]["<|pad|>"] = 1792  # no merge builds it: decodable, never produced
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>",
              "added_tokens_decoder": {"128000": {"content": "<|begin_of_text|>"}, "5": {"content": "<|x|>"}}}
    tok = load_tokenizer(write(tmp_path / "t", doc, config))
    # transformers adds added_tokens_decoder's tokens (by id) before bos_token, eos_token, ...
    assert tok.special_tokens == {"<|x|>": 1793, "<|begin_of_text|>": 1794, "<|end_of_text|>": 1795, "<|pad|>": 1792}
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1794, 1795, 1796)
    assert tok.decode([1792, 1794]) == "<|pad|><|begin_of_text|>"
    check_transformers_ids(tok, tmp_path / "t")
    other = load_tokenizer(write(tmp_path / "u", _small_doc()))
    assert len({tok.fingerprint, other.fingerprint, load_tokenizer().fingerprint}) == 3
    check_rewrites(tok, tmp_path / "again")


@pytest.mark.parametrize("config", [
    {"bos_token": "<|begin_of_text|>", "pad_token": "<pad>", "unk_token": "<unk>"},
    {"bos_token": "<B>", "added_tokens_decoder": {"2000": {"content": "<b>"}, "1999": {"content": "<a>"}}},
    {"additional_special_tokens": ["<c>", {"__type": "AddedToken", "content": "<d>"}, "<|eot_id|>"]},
    {"extra_special_tokens": {"image_token": "<image>"}, "mask_token": "<mask>"},
    {"extra_special_tokens": {}, "additional_special_tokens": ["<c>"]},  # transformers 4.5x writes both
])
def test_tokens_tokenizer_config_adds_get_transformers_ids(tmp_path, config):
    tok = load_tokenizer(write(tmp_path, _small_doc(), config))
    assert len(tok.special_tokens) > 3
    check_transformers_ids(tok, tmp_path)


def _hf_trained(folder):
    """A byte-level BPE trained and saved by `tokenizers`: specials first in the vocab, one added after."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|pad|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(MIXED * 3, trainer)
    tok.add_special_tokens(["<|im_start|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder, tok


def tokenizers_id(doc, token):
    return tokenizers.Tokenizer.from_str(json.dumps(doc)).token_to_id(token)


def _specials_outside_the_vocab():
    """Specials at low ids left out of the vocab, as 0.7.1's writer wrote them: (doc, token, stated id)."""
    doc = doc_of(Tokenizer(shifted_ids(3), special_tokens={"<s>": 0, "</s>": 1}, bos_id=0, eos_id=1))
    for token in ("<s>", "</s>"):
        del doc["model"]["vocab"][token]
    return doc, "<s>", 0


def _added_tokens_out_of_id_order():
    doc = _small_doc()
    doc["added_tokens"].reverse()
    return doc, "<|eot_id|>", 1794


@pytest.mark.parametrize("make", [_specials_outside_the_vocab, _added_tokens_out_of_id_order])
def test_added_token_ids_tokenizers_would_not_give_are_refused(tmp_path, make):
    doc, token, stated = make()
    given = tokenizers_id(doc, token)
    assert given != stated
    with pytest.raises(ValueError, match=rf"^\S+tokenizer.json: added token {regex.escape(repr(token))} has id "
                                         rf"{stated}, but tokenizers gives it id {given} \("):
        load_tokenizer(write(tmp_path, doc))


def test_files_tokenizers_wrote_read_with_its_ids(tmp_path):
    folder, reference = _hf_trained(tmp_path / "hf")
    tok = load_tokenizer(folder)
    assert tok.special_tokens == {"<|endoftext|>": 0, "<|pad|>": 1, "<|im_start|>": 600}
    check_transformers_ids(tok, folder)
    for text in texts():
        assert tok.encode(text, False, False) == reference.encode(text, add_special_tokens=False).ids


def test_an_added_token_given_a_vocab_tokens_id_is_refused(tmp_path):
    # ids with gaps: the vocab's size, where tokenizers numbers a new added token, is a vocab token's id
    doc = doc_of(Tokenizer({t: i for t, i in RANKS.items() if b"q" not in t}, special_tokens={"<|eot|>": 1792},
                           bos_id=1792, eos_id=1792))
    del doc["model"]["vocab"]["<|eot|>"]
    size = len(doc["model"]["vocab"])
    doc["added_tokens"][0]["id"] = size
    holder = next(key for key, i in doc["model"]["vocab"].items() if i == size)
    assert tokenizers_id(doc, "<|eot|>") == tokenizers_id(doc, holder) == size
    with pytest.raises(ValueError, match=rf"tokenizer.json: added token '<\|eot\|>' gets id {size} from tokenizers, "
                                         rf"the id of token '{holder}' in model.vocab$"):
        load_tokenizer(write(tmp_path, doc))


def test_folder_prefers_tokenizer_json(tmp_path):
    write(tmp_path, _small_doc(), {"eos_token": "<|eot_id|>"})
    tessera.data.write_ranks(RANKS, tmp_path / "tokenizer.model")
    assert load_tokenizer(tmp_path).eos_id == 1794
    (tmp_path / "tokenizer.json").unlink()
    assert load_tokenizer(tmp_path).eos_id == 1793 and load_tokenizer(tmp_path).name == "tokenizer.model"


def _edit(doc, path, value):
    *parents, last = path
    for p in parents:
        doc = doc[p]
    doc[last] = value


@pytest.mark.parametrize("edit, message", [
    ((["model", "type"], "WordPiece"), r"model type 'WordPiece' is not supported \(byte-level BPE only\)"),
    ((["normalizer"], {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}),
     r"normalizer 'Lowercase' is not supported \(only none or NFC\)"),
    ((["pre_tokenizer"], {"type": "Whitespace"}), r"pre_tokenizer must end with ByteLevel"),
    ((["pre_tokenizer", "pretokenizers", 0], {"type": "Digits", "individual_digits": True}),
     r"pre_tokenizer 'Digits' is not supported"),
    ((["pre_tokenizer", "pretokenizers", 0, "behavior"], "Removed"),
     r"pre_tokenizer Split with behavior 'Removed' is not supported"),
    ((["pre_tokenizer", "pretokenizers", 1, "add_prefix_space"], True),
     r"pre_tokenizer ByteLevel add_prefix_space=true"),
    ((["pre_tokenizer", "pretokenizers", 0, "pattern"], {"Regex": "(?<"}),
     r"pre_tokenizer Split regex '\(\?<' does not compile"),
    ((["model", "merges", 3], ["Ġt", "zzz"]), r"merge #3 \['Ġt', 'zzz'\] uses or makes a token not in model.vocab"),
    ((["model", "vocab", "!"], 34), r"model.vocab gives id 34 to more than one token"),
    ((["model", "unk_token"], "<unk>"), None),  # every byte has a token: the unk token is never used
])
def test_unsupported_parts_are_one_line_errors(tmp_path, edit, message):
    doc = _small_doc()
    _edit(doc, *edit)
    folder = write(tmp_path / "t", doc)
    if message is None:
        assert load_tokenizer(folder).vocab_size == 1795
        return
    with pytest.raises(ValueError, match=r"^[^\n]*tokenizer.json: " + message + r"[^\n]*$"):
        load_tokenizer(folder)


@pytest.mark.parametrize("edit, message", [
    ((["normalizer"], "NFC"), "normalizer must be an object, not a string"),
    ((["normalizer"], {"type": "Sequence", "normalizers": None}), "normalizer.normalizers must be a list, not null"),
    ((["pre_tokenizer"], "ByteLevel"), "pre_tokenizer must be an object, not a string"),
    ((["pre_tokenizer"], [1]), "pre_tokenizer must be an object, not a list"),
    ((["pre_tokenizer", "pretokenizers"], None), "pre_tokenizer.pretokenizers must be a list, not null"),
    ((["pre_tokenizer", "pretokenizers", 1], 5), r"pre_tokenizer.pretokenizers\[1\] must be an object, not an integer"),
    ((["pre_tokenizer", "pretokenizers", 0, "pattern"], "abc"), "pre_tokenizer Split pattern must be an object"),
    ((["pre_tokenizer", "pretokenizers", 0, "pattern"], {"Regex": 5}),
     "pre_tokenizer Split pattern.Regex must be a string, not an integer"),
    ((["model", "merges"], 5), "model.merges must be a list, not an integer"),
    ((["model", "merges"], {"Ġ t": 0}), "model.merges must be a list, not an object"),
    ((["model", "vocab", "!"], True), "model.vocab must map tokens to non-negative ids"),
    ((["added_tokens"], 5), "added_tokens must be a list, not an integer"),
])
def test_malformed_field_types_are_one_line_errors_naming_the_field(tmp_path, edit, message):
    doc = _small_doc()
    _edit(doc, *edit)
    with pytest.raises(ValueError, match=r"^[^\n]*tokenizer.json: " + message + r"[^\n]*$"):
        load_tokenizer(write(tmp_path / "t", doc))


def _with_added(*tokens, doc=None):
    doc = doc or _small_doc()
    doc["added_tokens"] += [{**doc["added_tokens"][0], "id": i, "content": content} for content, i in tokens]
    return doc


@pytest.mark.parametrize("doc, message", [
    (_with_added(("<y>", -5)), r"added_tokens entry .* lacks a string content or a non-negative integer id"),
    (_with_added(("<z>", 5)), r"added token '<z>' has id 5, but tokenizers gives it id 1795 \(a model.vocab token"),
    (_with_added(("<a>", 1795), ("<b>", 1795)), r"added token '<b>' has id 1795, but tokenizers gives it id 1796"),
    (_with_added(("<a>", 1795), ("<a>", 1796)), r"added token '<a>' has id 1796, but tokenizers gives it id 1795"),
    (_with_added(("!", 1795)), r"added token '!' has id 1795, but tokenizers gives it id 33"),
    (_with_added(("<x>", 10**9)), r"token id 1000000000 is beyond the 1796 tokens: ids must be below 65536 \(twice"),
    (_with_added(("<x>", 65536)), r"token id 65536 is beyond the 1796 tokens: ids must be below 65536"),
    (_with_added(("zzzq", 65535), ("!", 33), ("Ġt", _small_doc()["model"]["vocab"]["Ġt"]), ("zzzq", 65535),
                 doc=doc_of(Tokenizer(RANKS, decode_only={65535: b"zzzq"}))), None),  # restated, the highest id allowed
])
def test_token_ids_are_non_negative_unique_and_dense(tmp_path, doc, message):
    folder = write(tmp_path / "t", doc)
    if message is None:
        assert load_tokenizer(folder).vocab_size == 65536
        return
    with pytest.raises(ValueError, match=r"^[^\n]*tokenizer.json: " + message + r"[^\n]*$"):
        load_tokenizer(folder)


def test_a_vocab_id_far_beyond_the_tokens_is_refused_before_allocating(tmp_path):
    doc = _small_doc()
    doc["model"]["vocab"]["zzzq"] = 10**12  # a decode table of 10**12 entries: MemoryError
    with pytest.raises(ValueError, match=r"tokenizer.json: token id 1000000000000 is beyond the 1796 tokens"):
        load_tokenizer(write(tmp_path / "t", doc))


def test_malformed_companion_files_and_deep_nesting(tmp_path):
    write(tmp_path, _small_doc(), {"added_tokens_decoder": [{"content": "x"}]})
    with pytest.raises(ValueError, match=r"tokenizer_config.json: added_tokens_decoder must be an object, not a list$"):
        load_tokenizer(tmp_path)
    write(tmp_path, _small_doc(), {}, {"eos_token_id": True})  # true is not id 1
    with pytest.raises(ValueError, match=r"config.json: eos_token_id True is not a token of \S+tokenizer.json$"):
        load_tokenizer(tmp_path)
    doc = json.dumps({**_small_doc(), "pre_tokenizer": None})
    deep = '{"type": "Sequence", "pretokenizers": [' * 3000 + "]}" * 3000  # beyond any recursion limit
    (tmp_path / "tokenizer.json").write_text(doc.replace('"pre_tokenizer": null', f'"pre_tokenizer": {deep}'))
    with pytest.raises(ValueError, match=r"^\S+tokenizer.json: [^\n]+$"):
        load_tokenizer(tmp_path)


def test_malformed_files(tmp_path):
    with pytest.raises(ValueError, match=r"^\S+/empty: folder holds no tokenizer.json or tokenizer.model$"):
        (tmp_path / "empty").mkdir()
        load_tokenizer(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"model": {"type": "BPE",\n "vocab": {"a": 0,}}}')
    with pytest.raises(ValueError, match=r"bad/tokenizer.json:2: not valid JSON \(Expecting property name"):
        load_tokenizer(bad)
    (bad / "tokenizer.json").write_text("[]")
    with pytest.raises(ValueError, match=r"bad/tokenizer.json: expected a JSON object"):
        load_tokenizer(bad)
    write(bad, _small_doc(), {"eos_token": 7})
    with pytest.raises(ValueError, match=r"bad/tokenizer_config.json: eos_token must be a string or an object"):
        load_tokenizer(bad)
    write(bad, _small_doc(), {"eos_token": None}, {"eos_token_id": 99999})
    with pytest.raises(ValueError, match=r"bad/config.json: eos_token_id 99999 is not a token of .*tokenizer.json"):
        load_tokenizer(bad)
    doc = _small_doc()
    doc["added_tokens"] = []
    write(bad, doc, {}, {})
    with pytest.raises(ValueError, match=r"bad/tokenizer.json: no end-of-text token"):
        load_tokenizer(bad)
    with pytest.raises(FileNotFoundError, match="tokenizer file not found: .*nope.json"):
        load_tokenizer(tmp_path / "nope.json")
