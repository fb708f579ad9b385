"""Streaming token ids -> text without ever emitting half a character.

A byte-level BPE token can end in the middle of a multi-byte UTF-8 character (an emoji is often
split over two or three tokens), so text cannot be produced token by token from ``decode``.
``IncrementalDetokenizer`` feeds each token's bytes to an incremental UTF-8 decoder, which holds
an incomplete character until its remaining bytes arrive: O(1) work per token, never re-decoding
the sequence.
"""

from __future__ import annotations

import codecs

from engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Text for one stream of generated token ids.

    The concatenation of every ``add()`` result and the final ``flush()`` equals
    ``tokenizer.decode(all_ids, skip_special_tokens=skip_special_tokens)``. For valid UTF-8 no
    result contains U+FFFD; bytes that can never form a character are replaced by U+FFFD as soon
    as that is certain, and an incomplete trailing character only at ``flush()``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []

    def add(self, token_id: int) -> str:
        """Consume one token; return the text it completes (possibly ``""``).

        Raises ``InvalidRequestError`` for an id outside the tokenizer's vocabulary.
        """
        tokenizer = self._tokenizer
        if self._skip_special_tokens and tokenizer.is_special(token_id):
            return ""
        piece = self._decoder.decode(tokenizer.token_bytes(token_id))
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """End of stream: return the held bytes of an unfinished character as U+FFFD (``""`` if
        none). The detokenizer may keep going afterwards as a fresh byte stream."""
        piece = self._decoder.decode(b"", final=True)
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """Everything emitted so far by ``add`` and ``flush``."""
        if len(self._pieces) > 1:
            # Collapse so repeated reads stay linear overall
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
