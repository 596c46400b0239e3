"""Text as the simulated engine sees it: a word is a token, chats render as plain text, and block
hashes chain over token ids, so that requests sharing a text prefix share its cached blocks.

A word's id is its CRC-32, the same in every process and for every client; a client may also
send token ids (`/v1/completions` with a list of integers). Answers are made of words from a
fixed list, picked from the prompt's last token, so an answer sent back in the next prompt
(as an agent's history does) tokenizes to exactly the tokens the engine sampled.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CHAT_START = "<|im_start|>"
CHAT_END = "<|im_end|>"
ANSWER_WORDS: tuple[str, ...] = (
    "the", "file", "test", "change", "function", "value", "line", "error",
    "check", "run", "code", "patch", "read", "fix", "case", "output",
)  # fmt: skip
# The chain's seed: the hash "before" the first block.
ROOT_HASH = 0


def token_ids(text: str) -> list[int]:
    """One token per whitespace-separated word."""
    return list(map(zlib.crc32, text.encode(errors="surrogatepass").split()))


def content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts; anything else is empty."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return " ".join(text for text in texts if isinstance(text, str))
    return ""


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """The chat template: every marker is a word of its own, so that a turn's tokens are the same
    whether it is being generated or sent back as history."""
    turns = [f"{CHAT_START} {m.get('role', '')} {content_text(m.get('content'))} {CHAT_END}" for m in messages]
    return " ".join([*turns, f"{CHAT_START} assistant"])


def answer_words(prompt: Sequence[int], count: int) -> list[str]:
    """The `count` words a request answers with; the same prompt always gets the same answer."""
    first = prompt[-1] if prompt else 0
    return [ANSWER_WORDS[(first + i) % len(ANSWER_WORDS)] for i in range(count)]


@dataclass(frozen=True)
class ContentStream:
    """A request's tokens (its prompt, then its answer) seen as block hashes: block i's hash
    covers every token up to the end of block i, so two requests share a block only when they
    share all the text before it, as vLLM's chained block hashes do."""

    hashes: tuple[int, ...]

    @classmethod
    def of(cls, tokens: Sequence[int], block_size: int) -> ContentStream:
        """The chained hashes of the full blocks of `tokens` (a partial last block has none)."""
        hashes, chained = [], ROOT_HASH
        for start in range(0, len(tokens) - block_size + 1, block_size):
            chained = hash((chained, *tokens[start : start + block_size]))
            hashes.append(chained)
        return cls(tuple(hashes))

    def block_hashes(self, start: int, stop: int) -> list[int]:
        return list(self.hashes[start:stop])
