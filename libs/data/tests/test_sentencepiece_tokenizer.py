"""SentencePiece tokenizers against the libraries transformers runs: tokenizer.json files (Llama 2's
layout, transformers' non-legacy Metaspace one, a Unigram) against `tokenizers`, tokenizer.model
files (a Llama 2-like BPE with byte fallback, a Unigram) against `sentencepiece`, on unicode,
whitespace runs, byte-fallback characters and special tokens in text; special tokens in text for
the byte-level (tiktoken) path against `tokenizers` too, flags included. Every tokenizer is trained
here on a few KB of text; nothing is downloaded."""

import importlib
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers

import tessera.data
from tessera.data import (SentencePieceTokenizer, Tokenizer, load_dataset, load_tokenizer, read_ranks, tokenizer_file,
                          write_hf_tokenizer)
from tessera.data.added_tokens import TokenMatch

DEFAULT_MODEL = Path(tessera.data.__file__).parent / "assets" / "tokenizer.model"
TRAIN_LINES = [line for line in load_dataset()[0][:6000].splitlines() if line.strip()] + [
    "The quick brown fox jumps over the lazy dog.", "café naïve résumé", "世界你好 日本語のテキスト",
    "  indented\tand\ttabbed"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
CASES = [
    "", "hello world", "Hello  world,   three   spaces", "  leading", "trailing  ", "   ", "\t", "tabs\tand\t\ttabs",
    "new\nlines\n\n\nend\n", " \n \t mixed \r\n", "café naïve Ångström e\u0301 a\u0308", "世界你好 日本語 한국어",
    "emoji 👋🏽👨‍👩‍👧‍👦 🇯🇵", "rare CJK 𠀋𡈽𪚥 龘", "control \x00\x07\x1b[0m", "numbers 1234567890 3.14159",
    "<s>", "</s>", "<s>hello</s>", "a <s> b </s> c", " <unk> x", "<s><s></s>", "<|user|> hi<|user|>", "<s </s",
]
CASES.append("\n".join(CASES))
HAS_SPECIAL = re.compile(r"</?s>|<unk>|<\|user\|>")


def bpe_json(folder, legacy, config=None):
    """A SentencePiece-style BPE with byte fallback as transformers writes one: Llama 2's layout
    (legacy: "▁" prefix and spaces by normalizers) or its non-legacy one (Metaspace, prefix on the
    first piece only); <0x..> byte tokens in the vocab, not added tokens."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", *BYTES], limit_alphabet=60,
                                  show_progress=False)
    tok.train_from_iterator(TRAIN_LINES, trainer)
    tok.add_tokens([AddedToken("<|user|>", lstrip=True, rstrip=True, special=True, normalized=False)])
    doc = json.loads(tok.to_str())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] not in BYTES]
    return write_folder(folder, doc, config)


def unigram_json(folder):
    tok = tokenizers.SentencePieceUnigramTokenizer()
    tok.train_from_iterator(TRAIN_LINES, vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>",
                            show_progress=False)
    return write_folder(folder, json.loads(tok.to_str()))


def write_folder(folder, doc, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def sp_model(folder, **options):
    """A SentencePiece tokenizer.model trained here (default: Llama 2's options, a smaller vocabulary)."""
    llama2 = dict(model_type="bpe", vocab_size=600, byte_fallback=True, normalization_rule_name="identity",
                  remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
                  character_coverage=0.995, user_defined_symbols=["<|user|>"])
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TRAIN_LINES), model_writer=model, minloglevel=2,
                                   **{**llama2, **options})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return folder


def sp_reference(sp, text):
    """transformers' rule on SentencePiece: control and unknown pieces cut out of the text, each
    text between them encoded by SentencePiece on its own."""
    specials = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    parts = re.split("(" + "|".join(map(re.escape, specials)) + ")", text)
    return [i for k, part in enumerate(parts) if part for i in ([specials[part]] if k % 2 else sp.encode(part))]


def sp_decode_reference(sp, ids):
    """transformers' decode on SentencePiece: special pieces as their text (<unk> too, where
    SentencePiece writes " ⁇ "), each run between them decoded by SentencePiece."""
    text, run = "", []
    for i in ids:
        if sp.is_control(i) or sp.is_unknown(i):
            text, run = text + sp.decode(run) + sp.id_to_piece(i), []
        else:
            run.append(i)
    return text + sp.decode(run)


@pytest.mark.parametrize("kind", ["llama2 legacy", "metaspace", "unigram"])
def test_tokenizer_json_ids_and_text_equal_the_tokenizers_library(tmp_path, kind):
    folder = unigram_json(tmp_path) if kind == "unigram" else bpe_json(tmp_path, legacy=kind == "llama2 legacy")
    tok, reference = load_tokenizer(folder), tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert isinstance(tok, SentencePieceTokenizer) and tok.name == f"{tmp_path.name}/tokenizer.json"
    assert (tok.bos_id, tok.eos_id) == (1, 2)  # <s>, </s> by their names: no tokenizer_config.json
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    for text in CASES:
        ids = tok.encode(text, bos=False, eos=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert tok.encode(text, bos=True, eos=True) == [1, *ids, 2]
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=False), text
        if kind == "llama2 legacy" and not HAS_SPECIAL.search(text):  # byte fallback: every character survives
            assert tok.decode(ids) == text
    rare = [reference.id_to_token(i) for i in tok.encode("𠀋", False, False)]
    assert ("<unk>" if kind == "unigram" else "<0xF0>") in rare  # not in the vocabulary: bytes or unknown
    assert tok.encode("a<s>b", False, False).count(1) == 1  # special-token text is that token
    with pytest.raises(ValueError, match=r"^token id 9999 is outside the vocabulary \[0, \d+\) or has no token$"):
        tok.decode([5, 9999])


def test_tokenizer_config_names_bos_eos_and_adds_its_tokens(tmp_path):
    config = {"bos_token": {"content": "</s>", "__type": "AddedToken"}, "eos_token": "<s>", "pad_token": "<pad>"}
    tok = load_tokenizer(bpe_json(tmp_path / "t", legacy=True, config=config))
    assert (tok.bos_id, tok.eos_id) == (2, 1)
    assert tok.special_tokens["<pad>"] == 701 and tok.vocab_size == 702  # after <|user|> (700), as transformers does
    assert tok.encode("x<pad>y", False, False).count(701) == 1 and tok.decode([701]) == "<pad>"
    plain = load_tokenizer(bpe_json(tmp_path / "u", legacy=True))
    assert tok.fingerprint != plain.fingerprint == load_tokenizer(tmp_path / "u").fingerprint
    assert plain.fingerprint != load_tokenizer(bpe_json(tmp_path / "v", legacy=False)).fingerprint


@pytest.mark.parametrize("config", [
    {"added_tokens_decoder": {"900": {"content": "<b>"}, "800": {"content": "<a>"}}, "bos_token": "<B>"},
    {"pad_token": "<pad>", "unk_token": "<UNK>", "additional_special_tokens": ["<c>"]},
])
def test_tokens_tokenizer_config_adds_get_transformers_ids(tmp_path, config):
    from transformers import AutoTokenizer

    tok = load_tokenizer(bpe_json(tmp_path, legacy=True, config=config))
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto.get_added_vocab() == tok.special_tokens and len(tok.special_tokens) > 4
    text = " ".join([*CASES[:6], *tok.special_tokens])
    assert tok.encode(text, False, False) == auto.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("kind", ["llama2 bpe", "unigram nfkc"])
def test_tokenizer_model_ids_equal_sentencepiece(tmp_path, kind):
    options = {} if kind == "llama2 bpe" else dict(model_type="unigram", vocab_size=300, byte_fallback=False,
                                                    normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=True)
    folder = sp_model(tmp_path, **options)
    tok, sp = load_tokenizer(folder), spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert tokenizer_file(folder) == (str(folder / "tokenizer.model"), "sentencepiece")
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (sp.bos_id(), sp.eos_id(), sp.get_piece_size())
    assert tok.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}
    for text in CASES:
        ids = tok.encode(text, bos=False, eos=False)
        assert ids == sp_reference(sp, text), text
        assert tok.decode(ids) == sp_decode_reference(sp, ids), text
        if not HAS_SPECIAL.search(text):
            assert ids == sp.encode(text)
        if kind == "llama2 bpe":  # identity normalization and byte fallback: every text comes back
            assert tok.decode(ids) == text
    rare = [sp.id_to_piece(i) for i in tok.encode("𠀋", False, False)]
    assert ("<0xF0>" if kind == "llama2 bpe" else "<unk>") in rare
    assert tok.decode(tok.encode("a</s>", True, True)) == "<s>a</s></s>"
    assert tok.decode([0]) == "<unk>" and sp.decode([0]) == " ⁇ "


@pytest.mark.parametrize("config", [None, {"unk_token": "<UNK>", "pad_token": "<pad>"}, {"bos_token": "<B>"}])
def test_tokenizer_model_special_tokens_are_transformers(tmp_path, config):
    """Control pieces are special; the unknown piece too, unless tokenizer_config.json names another."""
    from transformers import AutoTokenizer

    folder = sp_model(tmp_path, control_symbols=["<ctl>"])
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert tok.special_tokens == auto.get_added_vocab()
    for text in [*CASES, "a<ctl>b<UNK><pad> <B>"]:
        assert tok.encode(text, False, False) == auto.encode(text, add_special_tokens=False), text


def test_sentencepiece_bos_eos_and_config_tokens(tmp_path):
    folder = sp_model(tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "</s>", "pad_token": "<pad>"}))
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id) == (2, 2)  # tokenizer_config.json's BOS first, the model's own EOS
    assert tok.special_tokens["<pad>"] == 600 and tok.vocab_size == 601
    assert tok.encode("a<pad>", False, False)[-1] == 600 and tok.decode([600, 600]) == "<pad><pad>"
    assert tok.name == f"{tmp_path.name}/tokenizer.model"


def test_folders_and_formats_are_told_apart_by_content(tmp_path):
    both = bpe_json(sp_model(tmp_path / "both"), legacy=True)
    assert tokenizer_file(both) == (str(both / "tokenizer.json"), "tokenizer.json")
    assert load_tokenizer(both).name == "both/tokenizer.json"
    llama3 = tmp_path / "llama3"  # tiktoken's ASCII lines under the same name
    llama3.mkdir()
    shutil.copyfile(DEFAULT_MODEL, llama3 / "tokenizer.model")
    assert tokenizer_file(llama3) == (str(llama3 / "tokenizer.model"), "tiktoken")
    assert load_tokenizer(llama3).fingerprint == load_tokenizer().fingerprint


def test_byte_level_specials_in_text_equal_the_tokenizers_library(tmp_path):
    """The tiktoken path finds special tokens as HF does: the default tokenizer as written for HF,
    and tokens with each added_tokens flag (normalized under NFC, lstrip, rstrip, single_word)."""
    ranks = read_ranks(DEFAULT_MODEL)
    specials = {"<|begin_of_text|>": 1792, "<|end_of_text|>": 1793, "<|x|>": 1794, "<|x|>y": 1795, "<L>": 1796,
                "<R>": 1797, "[w]": 1798, "é!": 1799}
    matching = {"<L>": TokenMatch(lstrip=True), "<R>": TokenMatch(rstrip=True), "[w]": TokenMatch(single_word=True),
                "é!": TokenMatch(normalized=True)}
    flagged = Tokenizer(ranks, "flags", special_tokens=specials, bos_id=1792, eos_id=1793, nfc=True,
                        matching=matching)
    texts = [*CASES, "<|begin_of_text|>a<|end_of_text|><|end_of_text|> <|begin_of_text| <|x|>y<|x|>z",
             "a  <L>  b\u3000<L>c\x1c<L>", "a  <R>  b<R>\u2028\u3000x<R>", "w[w]w [w] ([w]) _[w] 5[w]é[w]",
             "e\u0301! é! é!"]
    for tok, folder in ((load_tokenizer(), tmp_path / "default"), (flagged, tmp_path / "flags")):
        write_hf_tokenizer(tok, folder)
        reference, back = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")), load_tokenizer(folder)
        assert (back.matching, back.fingerprint) == (tok.matching, tok.fingerprint)
        for text in texts:
            ids = tok.encode(text, False, False)
            assert ids == back.encode(text, False, False), text
            assert ids == reference.encode(text, add_special_tokens=False).ids, text
    unflagged = Tokenizer(ranks, special_tokens=specials, bos_id=1792, eos_id=1793, nfc=True)
    assert flagged.fingerprint != unflagged.fingerprint


def test_byte_level_file_with_byte_fallback_goes_to_tokenizers(tmp_path):
    write_hf_tokenizer(load_tokenizer(), tmp_path)
    doc = json.loads((tmp_path / "tokenizer.json").read_text())
    doc["model"]["byte_fallback"] = True  # harmless there (every byte has a token): the library runs it
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, SentencePieceTokenizer)
    assert all(tok.encode(t, True, True) == load_tokenizer().encode(t, True, True) for t in CASES)


def test_bad_files_and_missing_libraries_are_one_line_errors(tmp_path, monkeypatch):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"QQ== 0\n\xff\xfe 1\n")
    with pytest.raises(ValueError, match=r"^\S+bad.model: not a tokenizer.model file: neither ASCII \(Llama 3's "
                                         r"format\) nor a SentencePiece model \([^\n]+\)$"):
        load_tokenizer(bad)
    doc = json.loads((unigram_json(tmp_path / "u") / "tokenizer.json").read_text())
    doc["model"]["vocab"] = "nonsense"
    write_folder(tmp_path / "u", doc)
    with pytest.raises(ValueError, match=r"^\S+u/tokenizer.json: tokenizers cannot read it \([^\n]+\)$"):
        load_tokenizer(tmp_path / "u")
    model, json_folder = sp_model(tmp_path / "m"), bpe_json(tmp_path / "j", legacy=True)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ValueError, match=r"^\S+m/tokenizer.model: reading a SentencePiece tokenizer.model \(not Llama "
                                         r"3's ASCII format\) needs sentencepiece: pip install sentencepiece$"):
        load_tokenizer(model)
    with pytest.raises(ValueError, match=r"^\S+j/tokenizer.json: reading a SentencePiece-style tokenizer.json needs "
                                         r"tokenizers: pip install tokenizers$"):
        load_tokenizer(json_folder)


def test_malformed_steps_and_far_ids_are_one_line_errors(tmp_path):
    write_hf_tokenizer(load_tokenizer(), tmp_path / "b")
    doc = json.loads((tmp_path / "b" / "tokenizer.json").read_text())
    for key, inner, steps, message in [  # told from SentencePiece-style files, then named by the reader
        ("pre_tokenizer", "pretokenizers", 5, "pre_tokenizer.pretokenizers must be a list, not an integer"),
        ("normalizer", "normalizers", {"a": 1}, "normalizer.normalizers must be a list, not an object"),
        ("pre_tokenizer", "pretokenizers", [{"type": ["x"]}], "pre_tokenizer must end with ByteLevel"),
    ]:
        write_folder(tmp_path / "b", {**doc, key: {"type": "Sequence", inner: steps}})
        with pytest.raises(ValueError, match=rf"^\S+b/tokenizer.json: {message}"):
            load_tokenizer(tmp_path / "b")
    doc = json.loads((bpe_json(tmp_path / "j", legacy=True) / "tokenizer.json").read_text())
    doc["model"]["vocab"]["▁zzzq"] = 10**9  # the model would get an embedding row per id up to it
    write_folder(tmp_path / "j", doc)
    with pytest.raises(ValueError, match=r"^\S+j/tokenizer.json: token id 1000000000 is beyond the \d+ tokens: ids "
                                         r"must be below 65536 \(twice the number of tokens, at least 65536\)"):
        load_tokenizer(tmp_path / "j")


def test_tessera_data_imports_and_reads_byte_level_files_without_either_library(tmp_path, monkeypatch):
    """tessera.data imported afresh with both libraries made unimportable (restored afterwards)."""
    write_hf_tokenizer(load_tokenizer(), tmp_path)
    original = tessera.data
    monkeypatch.setattr(tessera, "data", original)
    for name in [n for n in sys.modules if n == "tessera.data" or n.startswith("tessera.data.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    fresh = importlib.import_module("tessera.data")
    assert fresh is not original  # its modules all ran again
    hf, default = fresh.load_tokenizer(tmp_path), fresh.load_tokenizer()
    assert hf.encode("hi <|eot_id|>", True, True) == default.encode("hi <|eot_id|>", True, True)
