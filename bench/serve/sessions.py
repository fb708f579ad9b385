"""Conversation workloads for prefix reuse: ``Session`` lists (pure builders).

- ``build_multi_turn``: ``sessions`` conversations of ``turns`` turns over one shared system
  prompt. Turn ``k``'s request is the whole conversation so far: the system prompt, every
  earlier user message and the model's answer to it, then the new user message; so it is
  sent only once turn ``k - 1`` is answered (``session_runner``).
- ``build_shared_prefix``: ``users`` one-turn sessions over ``system_prompts`` system
  prompts, user ``u`` on system prompt ``u % system_prompts``.
- ``build_long_document``: ``sessions`` conversations, each over a document of its own
  (its system prompt, ``min_doc_tokens`` to ``max_doc_tokens`` words) with ``turns`` short
  questions: a working set of whole documents, for a KV store below the workers' pools.

Nonces keep what should not be shared unshared, and nothing else: every system prompt opens
with ``NONCE_WORDS`` fresh random words (so two runs never hit each other's cache, while
every session of one run shares the system prompt whole), and each session's first user
message opens with its own (so sessions share exactly the system prompt). Nonces come from
the operating system's randomness; everything else from ``seed``. Lengths count message
content, one token per word (``prompts.single_token_words``); the chat template adds a few
tokens around each message.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.serve.prompts import NONCE_WORDS, single_token_words
from bench.serve.workload import TAG_REQUEST, ChatMessage, RequestSpec
from engine.tokenizer import Tokenizer

TAG_FIRST_TURN = "first-turn"
TAG_LATER_TURN = "later-turn"


@dataclass(frozen=True)
class Session:
    """One conversation: a system prompt, then ``user_turns`` sent one after another, each
    asking for ``output_tokens`` tokens. ``index``: the session's number in its workload;
    ``system_index``: which of the workload's system prompts it uses."""

    index: int
    system_index: int
    system: str
    user_turns: tuple[str, ...]
    output_tokens: int
    multi_turn: bool = True

    @property
    def turns(self) -> int:
        return len(self.user_turns)


def turn_request(session: Session, turn: int, answers: Sequence[str]) -> RequestSpec:
    """Turn ``turn`` (0-based) of ``session``, given the answers to the turns before it:
    the system prompt, each earlier user message followed by its answer, the new message."""
    if not 0 <= turn < session.turns:
        raise ValueError(f"turn {turn} of a {session.turns}-turn session")
    if len(answers) != turn:
        raise ValueError(f"turn {turn} needs the {turn} answers before it, got {len(answers)}")
    messages = [ChatMessage("system", session.system)]
    for user, answer in zip(session.user_turns, answers, strict=False):
        messages += [ChatMessage("user", user), ChatMessage("assistant", answer)]
    messages.append(ChatMessage("user", session.user_turns[turn]))
    if not session.multi_turn:
        tag = TAG_REQUEST
    else:
        tag = TAG_FIRST_TURN if turn == 0 else TAG_LATER_TURN
    return RequestSpec(
        prompt_ids=(),
        prompt_text=session.user_turns[turn],
        output_tokens=session.output_tokens,
        tag=tag,
        messages=tuple(messages),
        session=session.index,
        turn=turn,
    )


class _Words:
    """Message texts of single-token words: nonces from ``nonce_rng``, filler seeded."""

    def __init__(self, tokenizer: Tokenizer, seed: int, nonce_rng: random.Random | None) -> None:
        self.tokenizer = tokenizer
        self.pool = single_token_words(tokenizer)
        self.filler = random.Random(seed)
        self.nonce = nonce_rng or random.SystemRandom()

    def text(self, n_words: int, *, nonce: bool) -> str:
        n_nonce = min(NONCE_WORDS, n_words) if nonce else 0
        ids = [self.nonce.choice(self.pool) for _ in range(n_nonce)]
        ids += [self.filler.choice(self.pool) for _ in range(n_words - n_nonce)]
        return self.tokenizer.decode(ids)


def build_multi_turn(
    tokenizer: Tokenizer,
    *,
    sessions: int,
    turns: int,
    system_tokens: int,
    user_tokens: int,
    output_tokens: int,
    seed: int = 0,
    nonce_rng: random.Random | None = None,
) -> list[Session]:
    """``sessions`` sessions of ``turns`` user messages of ``user_tokens`` words over one
    system prompt of ``system_tokens`` words (see the module docstring for the nonces)."""
    _check_positive(
        sessions=sessions,
        turns=turns,
        system_tokens=system_tokens,
        user_tokens=user_tokens,
        output_tokens=output_tokens,
    )
    words = _Words(tokenizer, seed, nonce_rng)
    system = words.text(system_tokens, nonce=True)
    return [
        Session(
            index=i,
            system_index=0,
            system=system,
            user_turns=tuple(words.text(user_tokens, nonce=t == 0) for t in range(turns)),
            output_tokens=output_tokens,
        )
        for i in range(sessions)
    ]


def build_shared_prefix(
    tokenizer: Tokenizer,
    *,
    system_prompts: int,
    users: int,
    system_tokens: int,
    user_tokens: int,
    output_tokens: int,
    seed: int = 0,
    nonce_rng: random.Random | None = None,
) -> list[Session]:
    """``users`` one-turn sessions; user ``u`` asks ``user_tokens`` words after system prompt
    ``u % system_prompts`` (each ``system_tokens`` words, each with its own nonce)."""
    _check_positive(
        system_prompts=system_prompts,
        users=users,
        system_tokens=system_tokens,
        user_tokens=user_tokens,
        output_tokens=output_tokens,
    )
    words = _Words(tokenizer, seed, nonce_rng)
    systems = [words.text(system_tokens, nonce=True) for _ in range(system_prompts)]
    return [
        Session(
            index=u,
            system_index=u % system_prompts,
            system=systems[u % system_prompts],
            user_turns=(words.text(user_tokens, nonce=True),),
            output_tokens=output_tokens,
            multi_turn=False,
        )
        for u in range(users)
    ]


def build_long_document(
    tokenizer: Tokenizer,
    *,
    sessions: int,
    turns: int,
    min_doc_tokens: int,
    max_doc_tokens: int,
    user_tokens: int,
    output_tokens: int,
    seed: int = 0,
    nonce_rng: random.Random | None = None,
) -> list[Session]:
    """``sessions`` multi-turn sessions, session ``i`` over its own document (its system
    prompt: a nonce, then a seeded length in ``[min_doc_tokens, max_doc_tokens]`` words),
    ``turns`` questions of ``user_tokens`` words each."""
    _check_positive(
        sessions=sessions,
        turns=turns,
        min_doc_tokens=min_doc_tokens,
        user_tokens=user_tokens,
        output_tokens=output_tokens,
    )
    if max_doc_tokens < min_doc_tokens:
        raise ValueError(f"max_doc_tokens {max_doc_tokens} < min_doc_tokens {min_doc_tokens}")
    words = _Words(tokenizer, seed, nonce_rng)
    lengths = random.Random(seed + 1)
    out = []
    for i in range(sessions):
        document = words.text(lengths.randint(min_doc_tokens, max_doc_tokens), nonce=True)
        questions = tuple(words.text(user_tokens, nonce=False) for _ in range(turns))
        out.append(Session(i, i, document, questions, output_tokens))
    return out


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
