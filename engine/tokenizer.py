"""Text <-> token ids for byte-level BPE checkpoints (GPT-2 style: SmolLM, Llama 3, Qwen 2).

The BPE itself runs in Hugging Face's ``tokenizers`` library. A GGUF file carries no
``tokenizer.json``, so ``Tokenizer.from_gguf`` rebuilds one from the ``tokenizer.ggml.*``
metadata: vocabulary, merges, token types (CONTROL tokens become special added tokens,
USER_DEFINED ones plain added tokens, both matched whole in the text) and a pre-tokenizer chosen
by ``tokenizer.ggml.pre`` that reproduces llama.cpp's split for that name.

Note on ``pre == "smollm"``: llama.cpp (and SmolLM's own ``tokenizer.json``) split off every
numeric character *before* the GPT-2 regex. transformers' GGUF loader does not know the name and
applies the GPT-2 regex alone; the two agree except where whitespace precedes a numeric character
(``"x  1"`` is ``x|ĠĠ|1`` here and in llama.cpp, ``x|Ġ|Ġ|1`` in transformers; ``" ½"`` is
``Ġ|Â½`` here, ``ĠÂ|½`` there). We follow llama.cpp and the model's training tokenizer.

Decoding does not go through the backend: every id has a precomputed byte string
(``token_bytes``), and ``decode`` joins those and decodes UTF-8 once, so ``decode`` and the
streaming ``IncrementalDetokenizer`` agree by construction.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from engine.chat_template import ChatTemplate
from engine.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from engine.gguf_file import read_metadata

# llama.cpp token types (gguf.TokenType)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Special tokens that end an assistant turn or a document in common chat vocabularies; when one
# of these is a special token, generation must stop on it even if the file names another eos.
_END_TOKEN_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|end|>",
        "<end_of_turn>",
        "<|return|>",
        "<EOT>",
    }
)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre names, grouped by the llama.cpp split they share
_PRE_GPT2 = frozenset({"default", "gpt2", "mpt", "olmo", "jais"})
_PRE_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_PRE_LLAMA3 = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"})
_PRE_QWEN2 = frozenset({"qwen2", "deepseek-r1-qwen"})
SUPPORTED_GGUF_PRE: frozenset[str] = _PRE_GPT2 | _PRE_DIGITS_THEN_GPT2 | _PRE_LLAMA3 | _PRE_QWEN2


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _PRE_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if pre in _PRE_LLAMA3 else _QWEN2_SPLIT if pre in _PRE_QWEN2 else None
    if split is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(SUPPORTED_GGUF_PRE)}"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_CHAR = _bytes_to_unicode()
_ALPHABET = frozenset(_BYTE_TO_CHAR.values())


class _UnspellTable(dict[int, str]):
    """``str.translate`` table that turns a byte-level spelled token into a latin-1 string whose
    code points are the token's bytes. A character outside the byte alphabet stands for its own
    UTF-8 bytes, as in the ``tokenizers`` ByteLevel decoder."""

    def __missing__(self, codepoint: int) -> str:
        latin1 = chr(codepoint).encode("utf-8").decode("latin-1")
        self[codepoint] = latin1
        return latin1


_UNSPELL = _UnspellTable({ord(ch): chr(b) for b, ch in _BYTE_TO_CHAR.items()})


def _unspell(token: str) -> bytes:
    return token.translate(_UNSPELL).encode("latin-1")


def _respell(token: str) -> str:
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


class Tokenizer:
    """A byte-level BPE tokenizer plus the chat template and special tokens of one checkpoint.

    Build with ``from_path`` (or ``from_gguf`` / ``from_hf_dir``). Instances are immutable and
    safe to share between threads for ``encode``/``decode``.

    Attributes:
        vocab_size: number of token ids (highest id + 1), added tokens included.
        bos_token_id: beginning-of-sequence id, or None.
        eos_token_id: the checkpoint's own eos id (the template's ``eos_token``), or None.
        eos_token_ids: ids that end generation: the checkpoint's eos plus end-of-turn /
            end-of-text special tokens such as ``<|im_end|>`` and ``<|endoftext|>``.
        add_bos_token: whether ``encode(..., add_special_tokens=True)`` prepends ``bos_token_id``.
    """

    def __init__(
        self,
        *,
        backend: _Backend,
        tokens: Sequence[str],
        added_ids: Iterable[int],
        special_ids: Iterable[int],
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        """Internal: use the ``from_*`` constructors."""
        self._backend = backend
        self._tokens: tuple[str, ...] = tuple(tokens)
        self.vocab_size: int = len(self._tokens)
        self._special_ids: frozenset[int] = frozenset(special_ids)
        added = frozenset(added_ids)
        # Added tokens are literal text (llama.cpp's token_to_piece copies them verbatim);
        # vocabulary tokens are spelled in the byte alphabet.
        self._bytes: list[bytes] = [
            tok.encode("utf-8") if i in added else _unspell(tok)
            for i, tok in enumerate(self._tokens)
        ]
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_id: int | None = eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids) | (
            {eos_token_id} if eos_token_id is not None else frozenset()
        )
        self.add_bos_token: bool = add_bos_token
        self._chat_template: ChatTemplate | None = None
        if chat_template:
            self._chat_template = ChatTemplate(
                chat_template,
                bos_token=self._tokens[bos_token_id] if bos_token_id is not None else None,
                eos_token=self._tokens[eos_token_id] if eos_token_id is not None else None,
            )

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Load from a GGUF file or a Hugging Face tokenizer directory.

        Raises ``ModelLoadError`` if ``path`` is neither.
        """
        p = Path(path)
        if p.is_dir():
            return cls.from_hf_dir(p)
        if p.is_file():
            with p.open("rb") as f:
                magic = f.read(4)
            if magic == b"GGUF" or p.suffix == ".gguf":
                return cls.from_gguf(p)
            raise ModelLoadError(f"{p}: not a GGUF file (no GGUF magic) nor a directory")
        raise ModelLoadError(f"{p}: no such file or directory")

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file's ``tokenizer.ggml.*`` and ``tokenizer.chat_template`` keys.

        Raises ``ModelLoadError`` for an unreadable file or missing tokenizer metadata and
        ``UnsupportedModelError`` for a tokenizer model other than ``gpt2`` (byte-level BPE) or
        a pre-tokenizer not in ``SUPPORTED_GGUF_PRE``.
        """
        p = Path(path)
        meta = read_metadata(p)
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise ModelLoadError(
                f"{p}: GGUF file has no tokenizer metadata (tokenizer.ggml.model is missing)"
            )
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"{p}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelLoadError(f"{p}: tokenizer.ggml.tokens is missing or empty")
        control, user_defined = _gguf_added_ids(meta, len(tokens), p)
        backend = _gguf_backend(meta, tokens, control, user_defined, p)
        literal = set(control) | set(user_defined)

        bos = _optional_id(meta, "tokenizer.ggml.bos_token_id", len(tokens), p)
        eos = _optional_id(meta, "tokenizer.ggml.eos_token_id", len(tokens), p)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        _set_template_processing(
            backend, tokens, bos if add_bos else None, eos if add_eos else None
        )

        eos_ids = {
            i
            for key in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            )
            if (i := _optional_id(meta, key, len(tokens), p)) is not None
        }
        eos_ids.update(i for i in control if tokens[i] in _END_TOKEN_TEXTS)
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend=backend,
            tokens=tokens,
            added_ids=literal,
            special_ids=control,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=eos_ids,
            add_bos_token=add_bos,
            chat_template=template if isinstance(template, str) else None,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face directory: ``tokenizer.json`` (required, byte-level BPE),
        plus ``tokenizer_config.json`` (bos/eos tokens, ``add_bos_token``/``add_eos_token``,
        chat template), ``chat_template.jinja`` / ``chat_template.json`` and
        ``generation_config.json`` (extra eos ids) when present.

        As in transformers, an explicit ``add_bos_token``/``add_eos_token`` in the config rebuilds
        the post-processor; otherwise ``tokenizer.json``'s post-processor decides.
        """
        d = Path(path)
        tokenizer_json = d / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ModelLoadError(f"{d}: no tokenizer.json in the directory")
        try:
            raw = tokenizer_json.read_text(encoding="utf-8")
            spec = json.loads(raw)
            backend = _Backend.from_str(raw)
        except Exception as exc:
            raise ModelLoadError(f"{tokenizer_json}: cannot be read: {exc}") from exc
        if not _is_byte_level(spec.get("decoder")):
            raise UnsupportedModelError(
                f"{tokenizer_json}: only byte-level BPE tokenizers are supported "
                f"(decoder is {(spec.get('decoder') or {}).get('type')!r})"
            )
        config = _read_json(d / "tokenizer_config.json")

        vocab = backend.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ModelLoadError(f"{tokenizer_json}: the vocabulary is empty")
        tokens = [""] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            tokens[i] = text
        added = backend.get_added_tokens_decoder()
        special_ids = [i for i, tok in added.items() if tok.special]

        bos = _config_token_id(config.get("bos_token"), backend)
        eos = _config_token_id(config.get("eos_token"), backend)
        if "add_bos_token" in config or "add_eos_token" in config:
            add_bos = bool(config.get("add_bos_token")) and bos is not None
            add_eos = bool(config.get("add_eos_token")) and eos is not None
            _set_template_processing(
                backend, tokens, bos if add_bos else None, eos if add_eos else None
            )
        # Whatever configured the post-processor, what it does is the truth
        probe = backend.encode("a", add_special_tokens=True).ids
        plain = backend.encode("a", add_special_tokens=False).ids
        add_bos = bos is not None and probe[:1] == [bos] and plain[:1] != [bos]

        eos_ids = {eos} if eos is not None else set()
        generation = _read_json(d / "generation_config.json").get("eos_token_id")
        for i in generation if isinstance(generation, list) else [generation]:
            if isinstance(i, int) and 0 <= i < len(tokens):
                eos_ids.add(i)
        eos_ids.update(i for i in special_ids if tokens[i] in _END_TOKEN_TEXTS)

        return cls(
            backend=backend,
            tokens=tokens,
            added_ids=added,
            special_ids=special_ids,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=eos_ids,
            add_bos_token=add_bos,
            chat_template=_hf_chat_template(d, config),
        )

    # -- encoding / decoding -----------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``. Special tokens written in the text (``<|im_start|>``) map to
        their ids; ``add_special_tokens`` adds the checkpoint's bos/eos as configured."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        # encode_batch lets go of the GIL while it works (encode holds it throughout), so a
        # long text tokenized on a thread does not stall the caller's event loop.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text for ``ids``; invalid UTF-8 (e.g. a truncated character) becomes U+FFFD.

        Raises ``InvalidRequestError`` for an id outside ``[0, vocab_size)``.
        """
        self._check_ids(ids)
        table = self._bytes
        if skip_special_tokens:
            special = self._special_ids
            data = b"".join([table[i] for i in ids if i not in special])
        else:
            data = b"".join([table[i] for i in ids])
        return data.decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry for ``token_id`` as the checkpoint spells it (``Ġhello``)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes ``token_id`` stands for; possibly part of a UTF-8 character. Special
        and other added tokens give their text as UTF-8."""
        self._check_id(token_id)
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (control) token such as ``<|im_end|>``."""
        self._check_id(token_id)
        return token_id in self._special_ids

    # -- chat --------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return self._chat_template is not None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template into prompt text (not ids:
        ``encode(prompt, add_special_tokens=False)`` gives the ids, because templates write
        bos themselves where the model expects it).

        Raises ``InvalidRequestError`` for malformed messages, a conversation the template
        rejects, or a checkpoint without a chat template (we do not guess a format).
        """
        if self._chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead of messages"
            )
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    # -- internals ---------------------------------------------------------------------------

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequestError(f"token id {token_id} is outside [0, {self.vocab_size})")

    def _check_ids(self, ids: Sequence[int]) -> None:
        if len(ids) and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise InvalidRequestError(f"token id {bad} is outside [0, {self.vocab_size})")


# -- helpers -----------------------------------------------------------------------------------


def _gguf_added_ids(
    meta: Mapping[str, Any], n_tokens: int, path: Path
) -> tuple[list[int], list[int]]:
    """The ids of CONTROL tokens (special) and USER_DEFINED ones (plain added tokens)."""
    types = meta.get("tokenizer.ggml.token_type")
    types = np.ones(n_tokens, dtype=np.int32) if types is None else np.asarray(types)
    if len(types) != n_tokens:
        raise ModelLoadError(
            f"{path}: {len(types)} token types for {n_tokens} tokens in tokenizer metadata"
        )
    control = [int(i) for i in np.nonzero(types == _TOKEN_TYPE_CONTROL)[0]]
    user_defined = [int(i) for i in np.nonzero(types == _TOKEN_TYPE_USER_DEFINED)[0]]
    return control, user_defined


def _gguf_backend(
    meta: Mapping[str, Any],
    tokens: list[str],
    control: list[int],
    user_defined: list[int],
    path: Path,
) -> _Backend:
    """The BPE of a GGUF's vocabulary and merges, its pre-tokenizer chosen by
    ``tokenizer.ggml.pre``, the added tokens matched whole in the text."""
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ModelLoadError(f"{path}: tokenizer.ggml.merges is missing")
    literal = set(control) | set(user_defined)
    # Vocabulary tokens are already byte-level spelled in a sane file; respell any that are
    # not, as transformers does. Added tokens keep their literal text so they match it.
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if i not in literal and not _ALPHABET.issuperset(tok):
            tok = _respell(tok)
        vocab.setdefault(tok, i)
    try:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = _Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as exc:
        raise ModelLoadError(f"{path}: tokenizer vocabulary/merges are invalid: {exc}") from exc
    backend.pre_tokenizer = _byte_level_pre_tokenizer(
        str(meta.get("tokenizer.ggml.pre", "default"))
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in control]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in user_defined]
    )
    for i in sorted(literal):
        if backend.token_to_id(tokens[i]) != i:
            raise ModelLoadError(f"{path}: added token {tokens[i]!r} (id {i}) is duplicated")
    return backend


def _optional_id(meta: Mapping[str, Any], key: str, n_tokens: int, path: Path) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < n_tokens:
        raise ModelLoadError(f"{path}: {key}={value!r} is not a token id below {n_tokens}")
    return value


def _set_template_processing(
    backend: _Backend, tokens: Sequence[str], bos: int | None, eos: int | None
) -> None:
    """Make ``encode(add_special_tokens=True)`` add bos/eos, the way transformers'
    ``update_post_processor`` does."""
    single = "$A:0"
    special: list[tuple[str, int]] = []
    if bos is not None:
        single = f"{tokens[bos]}:0 {single}"
        special.append((tokens[bos], bos))
    if eos is not None:
        single = f"{single} {tokens[eos]}:0"
        special.append((tokens[eos], eos))
    pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


def _is_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(
        _is_byte_level(d) for d in decoder.get("decoders", ())
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _config_token_id(value: Any, backend: _Backend) -> int | None:
    # tokenizer_config.json writes a token as a string or as a serialized AddedToken
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        return None
    return backend.token_to_id(value)


def _hf_chat_template(d: Path, config: Mapping[str, Any]) -> str | None:
    """The directory's default chat template; the standalone files win over the config entry,
    as in transformers."""
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(d / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: serving uses the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
