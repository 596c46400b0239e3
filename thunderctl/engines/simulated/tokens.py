"""Text as the simulated engine sees it: a word is a token, chats render as plain text, and block
hashes chain over token ids, so that requests sharing a text prefix share its cached blocks.

A word's id is its CRC-32, the same in every process and for every client; a client may also
send token ids (`/v1/completions` with a list of integers). Answers are made of words from a
fixed list, picked from the prompt's last token, so an answer sent back in the next prompt
(as an agent's history does) tokenizes to exactly the tokens the engine sampled.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
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


def call_text(arguments: Any) -> str:
    """A tool call's arguments as prompt text: the string values of its JSON object (a simulated
    call carries its answer's words as its one string), else the arguments as they are."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return str(arguments)
    if isinstance(parsed, dict):
        return " ".join(value if isinstance(value, str) else json.dumps(value) for value in parsed.values())
    return arguments if isinstance(arguments, str) else json.dumps(parsed)


def message_text(message: dict[str, Any]) -> str:
    """A message's text in the prompt: its content, then its tool calls' arguments."""
    calls = message.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    arguments = (((call.get("function") or {}) if isinstance(call, dict) else {}).get("arguments") for call in calls)
    return " ".join([content_text(message.get("content")), *(call_text(a) for a in arguments if a is not None)])


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """The chat template: every marker is a word of its own, so that a turn's tokens are the same
    whether it is being generated or sent back as history (a tool call as its arguments' text)."""
    turns = [f"{CHAT_START} {m.get('role', '')} {message_text(m)} {CHAT_END}" for m in messages]
    return " ".join([*turns, f"{CHAT_START} assistant"])


def answer_words(prompt: Sequence[int], count: int) -> list[str]:
    """The `count` words a request answers with; the same prompt always gets the same answer."""
    first = prompt[-1] if prompt else 0
    return [ANSWER_WORDS[(first + i) % len(ANSWER_WORDS)] for i in range(count)]


class BlockIds:
    """Block contents (chained hashes) to the integer ids the engine's block pool keys on.

    The pool wants a request's hashes as increasing runs of consecutive integers. A block's
    chained hash stands for all the text before it, so the blocks of a request already known
    are a prefix of it: they keep their ids, and its new blocks get one fresh run above every id
    given so far. The table forgets the least recently used contents beyond `capacity`, the
    last blocks of a prefix before its first ones (a forgotten content is a miss, as an evicted
    block is).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[int, int] = OrderedDict()
        self._next = 0

    def forget(self) -> None:
        """No content is known any more (a prefix cache reset): every block from now on is a miss.
        Ids keep rising, so no new block takes the id of one still in the pool."""
        self._ids.clear()

    def runs_of(self, chained: Sequence[int]) -> list[range]:
        ids = self._ids
        known: list[int] = []
        for block_hash in chained:
            block_id = ids.get(block_hash)
            if block_id is None:
                break
            known.append(block_id)
        for block_hash in reversed(chained[: len(known)]):  # a prefix's first blocks stay the longest
            ids.move_to_end(block_hash)
        fresh = range(self._next, self._next + len(chained) - len(known))
        self._next = fresh.stop
        ids.update(zip(chained[len(known) :], fresh))
        while len(ids) > self.capacity:
            ids.popitem(last=False)
        runs: list[range] = []
        for block_id in known:
            if runs and runs[-1].stop == block_id:
                runs[-1] = range(runs[-1].start, block_id + 1)
            else:
                runs.append(range(block_id, block_id + 1))
        return [*runs, fresh] if fresh else runs


@dataclass(frozen=True)
class ContentStream:
    """A request's tokens (its prompt, then its answer) seen as block hashes: block i's chained
    hash covers every token up to the end of block i, so two requests share a block only when
    they share all the text before it, as vLLM's chained block hashes do; the engine sees each
    content by its id in `BlockIds`."""

    runs: tuple[range, ...]

    @classmethod
    def of(cls, tokens: Sequence[int], block_size: int, ids: BlockIds) -> ContentStream:
        """The full blocks of `tokens` (a partial last block has no hash)."""
        chained, previous = [], ROOT_HASH
        for start in range(0, len(tokens) - block_size + 1, block_size):
            previous = hash((previous, *tokens[start : start + block_size]))
            chained.append(previous)
        return cls(tuple(ids.runs_of(chained)))

    def block_runs(self, start: int, stop: int) -> list[range]:
        runs, offset = [], 0
        for run in self.runs:
            lo, hi = max(start, offset), min(stop, offset + len(run))
            if lo < hi:
                runs.append(run[lo - offset : hi - offset])
            offset += len(run)
        return runs

    def block_hashes(self, start: int, stop: int) -> list[int]:
        return list(chain.from_iterable(self.block_runs(start, stop)))
