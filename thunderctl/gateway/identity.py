"""Program identity from the conversation: a request that names no program continues the one whose
answer it carries on from, or starts a new one.

The gateway relays every answer, so it knows each conversation it has served. After an answer it
remembers a few hashes of the conversation so far (never its text); the next request of the same
agent carries that history, and hashing it finds the program again:

- chat: the history is hashed message by message on a normal form that ignores how clients echo
  an answer back (whitespace, content as a string or as parts, tool-call arguments re-serialised,
  `name` added, reasoning dropped). A request continues a program when its messages up to an
  assistant message hash to a conversation remembered there, or, when the client rewrote its
  history (condensed it, truncated old observations), when its latest assistant message is the
  program's last answer under the same opening (the first message and the first user message, the
  task, which condensers keep). An answer alone is not enough: agents often answer alike (the same
  first command), and a conversation forgotten must not join another program. A request that
  extends a program's last *request* without its answer (the answer dropped and a correction
  appended, as agents do on a format error, or a retry with a nudge) continues that program too.
  The other chat-like APIs (Responses, Messages) come here in chat's form (`gateway/apis/`);
- completions: the prompt (text, or token ids as RL rollout workers send) continues a program when
  it starts with that program's last prompt and completion, or else with its last prompt alone (the
  completion dropped, or re-tokenized by a trainer into other ids). It is found through a hash of
  the prompt's head (the first 2^k units, k as large as the prompt allows), which leads to the few
  programs whose conversation began the same way; each is checked by a hash of its prefix.

Every match leads to the programs whose last answer it is; one not continued yet is taken first, so
n identical first requests (the n samples of a GRPO group) stay n programs even when answers
coincide. A new program's group is its first request: programs whose first requests are the same
(the same messages in the normal form above, or the same prompt) are one group, `first-<hash>`, as
the samples of one task in an RL rollout are. Memory is bounded by `remembered_conversations`, the least recently continued forgotten
first; the cost of a request grows with its size, never with the number of conversations.

Pure and synchronous: the gateway calls it around each relayed request.
"""

from __future__ import annotations

import json
import secrets
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from hashlib import blake2b
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from thunderctl.gateway.changes import ChangedKeys

DIGEST_BYTES = 16
WHITESPACE = b" \t\n\r\x0b\x0c"


class IdentityConfig(BaseModel):
    """The settings of derived identity: profile keys under `gateway:`, `serve` options."""

    model_config = ConfigDict(extra="forbid")

    derive_programs: bool = Field(
        True,
        description="a request that names no program belongs to the program whose conversation it continues "
        "(off: it is served unscheduled)",
    )
    remembered_conversations: int = Field(
        65_536,
        ge=1,
        description="conversations remembered for that (a few hashes each, about 1 KB); the least recently "
        "continued is forgotten first, and its next request starts a new program",
    )


@dataclass(frozen=True)
class Turn:
    """What a request says of its conversation, as identity hashes it: chat-like messages (each API's
    in chat's form, `gateway/apis/`), or else a completions prompt."""

    messages: list[Any] | None = None
    prompt: Any = None


class Match(StrEnum):
    """How a request found its program."""

    HISTORY = "history"  # its messages (or prompt) extend the program's last request and answer
    RETRIED = "retried"  # its messages extend the program's last request, its answer left out
    REWRITTEN = "rewritten"  # its history was rewritten; its latest assistant message is the program's answer
    NEW = "new"  # it continues nothing: a new program


@dataclass
class Claim:
    """One request's program, and what its answer needs to be remembered under."""

    program_id: str
    match: Match
    group: str | None = None  # a new program's: the hash of its first request, which its group shares
    _chain: bytes = b""  # chat: the hash of all the request's messages
    _opening: bytes = b""  # chat: the hash of its opening messages
    _prompt: Any = None  # completions: a hasher fed with the prompt
    _prompt_units: int = 0
    _head: bytes = b""  # completions: the key of the prompt's head
    _token_ids: bool = False

    @property
    def chat(self) -> bool:
        """Whether it is a chat-like request's (else a completions prompt's)."""
        return self._prompt is None


@dataclass
class _Conversation:
    """A program's last answer as the index holds it."""

    keys: tuple[bytes, ...]
    length: int = 0  # completions: units of prompt + completion
    digest: bytes = b""  # completions: the hash of those units
    continued: bool = False  # a request continued it since its answer
    touched: int = 0  # when it was last remembered or continued, in the index's count of those
    prompt_length: int = 0  # completions: units of the prompt alone (0: not known)
    prompt_digest: bytes = b""  # completions: the hash of those units


@dataclass(frozen=True)
class Remembered:
    """A conversation the index remembers, as plain data (hashes only): what its journal keeps."""

    program_id: str
    keys: tuple[bytes, ...]
    length: int
    digest: bytes
    continued: bool
    touched: int  # its place in the order of forgetting: the lowest is forgotten first
    prompt_length: int = 0
    prompt_digest: bytes = b""


@dataclass
class IndexSnapshot:
    """The index as plain data: its id prefix and count (new ids go on from them) and its conversations."""

    prefix: str
    started: int
    conversations: list[Remembered]  # any order: `touched` gives theirs


@dataclass
class _Bucket:
    """Programs under one key, those whose last answer was not continued yet apart."""

    fresh: dict[str, None] = field(default_factory=dict)
    continued: dict[str, None] = field(default_factory=dict)

    def pick(self) -> str | None:
        if self.fresh:
            return next(iter(self.fresh))
        return next(reversed(self.continued)) if self.continued else None


def _digest(*parts: bytes) -> bytes:
    return blake2b(b"".join(parts), digest_size=DIGEST_BYTES).digest()


def _text(content: Any) -> bytes:
    """Content as UTF-8 without its whitespace (so however a client spaced it); a list of parts
    joined. Deleting whitespace is one pass in C, where collapsing runs of it would build a string
    per word."""
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif isinstance(part, str):
                pieces.append(part)
            else:  # an image or other non-text part counts as it is
                pieces.append(json.dumps(part, sort_keys=True))
        content = "".join(pieces)
    elif not isinstance(content, str):
        content = "" if content is None else json.dumps(content, sort_keys=True)
    return content.encode(errors="surrogatepass").translate(None, WHITESPACE)


def _arguments(arguments: Any) -> bytes:
    """Tool-call arguments in one canonical JSON form, however the client serialised them."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return _text(arguments)
    return json.dumps(arguments, sort_keys=True, separators=(",", ":")).encode()


def message_digest(message: Any) -> bytes:
    """A message's normal form, hashed: role, text and tool calls; ids, `name`, reasoning and other
    fields left out."""
    if not isinstance(message, dict):
        return _digest(json.dumps(message, sort_keys=True).encode())
    hasher = blake2b(str(message.get("role")).encode(errors="surrogatepass"), digest_size=DIGEST_BYTES)
    hasher.update(b"\0" + _text(message.get("content")))
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            hasher.update(b"\0" + str(function.get("name")).encode(errors="surrogatepass"))
            hasher.update(b"\0" + _arguments(function.get("arguments")))
    return hasher.digest()


def _units(prompt: Any) -> tuple[bytes | memoryview, bool] | None:
    """A completions prompt as bytes of fixed width per unit (a character or a token id), or None
    for what cannot be followed (a batch of several prompts)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):  # prompt + completion encode as the prompt's bytes, then the completion's
        return prompt.encode(errors="surrogatepass"), False
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        try:  # array checks every id is an integer that fits, at C speed
            return memoryview(array("q", prompt)).cast("B"), True
        except (TypeError, OverflowError):
            return None
    return None


def _width(token_ids: bool) -> int:
    """Bytes per unit: a token id's 8, a text's bytes themselves (UTF-8)."""
    return 8 if token_ids else 1


def _heads(units: bytes | memoryview, width: int, token_ids: bool) -> tuple[list[bytes], Any]:
    """The keys of the prompt's heads (see _head_lengths), and a hasher fed with the whole prompt:
    one pass over it."""
    view, hasher, done, keys = memoryview(units), blake2b(digest_size=DIGEST_BYTES), 0, []
    for length in _head_lengths(len(units) // width):
        hasher.update(view[done : length * width])
        done = length * width
        keys.append(b"H" + bytes([token_ids]) + hasher.copy().digest())
    hasher.update(view[done:])
    return keys, hasher


def _head_lengths(units: int) -> list[int]:
    """The head lengths hashed for a prompt of this many units: every power of two up to it (their
    sum is under twice the prompt). A conversation is remembered under the longest of its prompt's,
    so those of a short head are the few programs whose prompt is about as short."""
    lengths, head = [], 1
    while head <= units:
        lengths.append(head)
        head *= 2
    return lengths or [0]


class ConversationIndex:
    """Which program each unnamed request continues; see the module's docstring."""

    def __init__(self, remembered: int) -> None:
        self.remembered = remembered
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()
        self._index: dict[bytes, _Bucket] = {}
        self._prefix = secrets.token_hex(4)  # derived ids of two gateways never meet in one trace
        self._started = 0
        self._touches = 0
        self.matched = {m: 0 for m in Match}
        self.changes = ChangedKeys()  # programs whose conversation changed: what the journal writes

    # ---- as plain data --------------------------------------------------------------------

    def numbering(self) -> tuple[str, int]:
        """The prefix of the ids it derives and how many it has started: new ids go on from there."""
        return self._prefix, self._started

    def snapshot(self) -> IndexSnapshot:
        return IndexSnapshot(*self.numbering(), [self._remembered(p) for p in self._conversations])

    def changed(self) -> tuple[list[Remembered], list[str]]:
        """Since the last call (once `changes.follow()` was called): the conversations remembered or
        continued, and the programs whose conversation was forgotten."""
        changed, forgotten = [], []
        for program_id in self.changes.take():
            if program_id in self._conversations:
                changed.append(self._remembered(program_id))
            else:
                forgotten.append(program_id)
        return changed, forgotten

    def restore(self, snapshot: IndexSnapshot) -> None:
        """Back to the snapshot: its conversations found again, and forgotten in the order they would have been."""
        self._prefix, self._started = snapshot.prefix, snapshot.started
        for remembered in sorted(snapshot.conversations, key=lambda r: r.touched)[-self.remembered :]:
            conversation = _Conversation(
                remembered.keys,
                remembered.length,
                remembered.digest,
                remembered.continued,
                remembered.touched,
                remembered.prompt_length,
                remembered.prompt_digest,
            )
            self._conversations[remembered.program_id] = conversation
            for key in conversation.keys:
                bucket = self._index.setdefault(key, _Bucket())
                (bucket.continued if conversation.continued else bucket.fresh)[remembered.program_id] = None
            self._touches = max(self._touches, remembered.touched)

    def _remembered(self, program_id: str) -> Remembered:
        c = self._conversations[program_id]
        return Remembered(
            program_id, c.keys, c.length, c.digest, c.continued, c.touched, c.prompt_length, c.prompt_digest
        )

    def _touch(self, program_id: str, conversation: _Conversation) -> None:
        self._touches += 1
        conversation.touched = self._touches
        self.changes.mark(program_id)

    def __len__(self) -> int:
        return len(self._conversations)

    # ---- a request ------------------------------------------------------------------------

    def claim(self, turn: Turn) -> Claim | None:
        """The program this request belongs to (None: one that cannot be followed, a batch of
        prompts, served unscheduled)."""
        if turn.messages is not None:
            claim: Claim | None = self._claim_chat(turn.messages)
        else:
            claim = self._claim_completion(turn.prompt)
        if claim is not None:
            self.matched[claim.match] += 1
        return claim

    def _claim_chat(self, messages: list[Any]) -> Claim:
        chain, chains, digests = b"", [], []
        for message in messages:
            digests.append(message_digest(message))
            chain = _digest(chain, digests[-1])
            chains.append(chain)
        opening = _opening(messages, digests)
        assistants = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
        keys = [b"C" + chains[i] for i in reversed(assistants)]
        rewritten = [b"O" + _digest(opening, digests[assistants[-1]])] if assistants else []
        # The requests this one extends, the longest first: never itself (the same request again is
        # a new sample of the same task, or a resend, as for first requests).
        retried = [b"R" + chains[i] for i in range(len(chains) - 2, -1, -1)]
        program, match = self._first(keys), Match.HISTORY
        if program is None:
            program, match = self._first(retried), Match.RETRIED
        if program is None:
            program, match = self._first(rewritten), Match.REWRITTEN
        return self._claimed(program, match, Claim("", Match.NEW, _chain=chain, _opening=opening))

    def _claim_completion(self, prompt: Any) -> Claim | None:
        found = _units(prompt)
        if found is None:
            return None
        units, token_ids = found
        width = _width(token_ids)
        count = len(units) // width
        heads, hasher = _heads(units, width, token_ids)
        # Conversation length → (digest, program): what each program's last prompt and completion,
        # and its last prompt alone, would be a prefix of this prompt as.
        extended: dict[int, list[tuple[bytes, str]]] = {}
        retried: dict[int, list[tuple[bytes, str]]] = {}
        for head in heads:
            bucket = self._index.get(head)
            for program in [*bucket.fresh, *bucket.continued] if bucket else []:
                conversation = self._conversations[program]
                # A continuation is longer than what it continues (a prompt whose completion is unknown
                # counts by its prompt alone).
                if conversation.length < count:
                    extended.setdefault(conversation.length, []).append((conversation.digest, program))
                if 0 < conversation.prompt_length < min(count, conversation.length):
                    retried.setdefault(conversation.prompt_length, []).append((conversation.prompt_digest, program))
        program, match = self._prefixed(units, width, extended), Match.HISTORY
        if program is None:
            program, match = self._prefixed(units, width, retried), Match.RETRIED
        pending = Claim("", Match.NEW, _prompt=hasher, _prompt_units=count, _head=heads[-1], _token_ids=token_ids)
        return self._claimed(program, match, pending)

    def _prefixed(
        self, units: bytes | memoryview, width: int, candidates: dict[int, list[tuple[bytes, str]]]
    ) -> str | None:
        """The program whose candidate prefix the prompt starts with, the longest first, one not
        continued yet before one continued already."""
        fallback = None
        for length in sorted(candidates, reverse=True):
            digest = blake2b(memoryview(units)[: length * width], digest_size=DIGEST_BYTES).digest()
            for expected, program in candidates[length]:
                if expected == digest:
                    if not self._conversations[program].continued:
                        return program
                    fallback = fallback or program
        return fallback

    def _first(self, keys: list[bytes]) -> str | None:
        """The first program under these keys (in this order of preference) not continued yet, else the
        first one continued already (a client that sent the same request again)."""
        fallback = None
        for key in keys:
            bucket = self._index.get(key)
            if bucket is None:
                continue
            if bucket.fresh:
                return bucket.pick()
            fallback = fallback or bucket.pick()
        return fallback

    def _claimed(self, program: str | None, match: Match, claim: Claim) -> Claim:
        if program is None:
            self._started += 1
            claim.program_id, claim.match = f"conv-{self._prefix}-{self._started}", Match.NEW
            first = claim._chain if claim._prompt is None else claim._prompt.digest()
            claim.group = f"first-{first.hex()}"
            return claim
        claim.program_id, claim.match = program, match
        conversation = self._conversations[program]
        self._conversations.move_to_end(program)
        self._touch(program, conversation)
        if not conversation.continued:
            conversation.continued = True
            for key in conversation.keys:
                bucket = self._index[key]
                del bucket.fresh[program]
                bucket.continued[program] = None
        return claim

    # ---- its answer -----------------------------------------------------------------------

    def answered_chat(self, claim: Claim, message: dict[str, Any]) -> None:
        """Remember the conversation as it stands after this answer (an assistant message)."""
        answer = message_digest({"role": "assistant", **message})
        keys = (b"C" + _digest(claim._chain, answer), b"O" + _digest(claim._opening, answer), b"R" + claim._chain)
        self._remember(claim.program_id, _Conversation(keys))

    def answered_completion(self, claim: Claim, text: str, token_ids: list[int] | None) -> None:
        """Remember prompt + completion (the completion's token ids when the prompt was ids: without
        them, the prompt alone)."""
        hasher = claim._prompt.copy()
        units = claim._prompt_units
        if claim._token_ids:
            completion = _units(token_ids) if token_ids else None
        else:
            completion = _units(text)
        if completion is not None:
            hasher.update(completion[0])
            units += len(completion[0]) // _width(claim._token_ids)
        conversation = _Conversation(
            (claim._head,),
            length=units,
            digest=hasher.digest(),
            prompt_length=claim._prompt_units,
            prompt_digest=claim._prompt.digest(),
        )
        self._remember(claim.program_id, conversation)

    def forget(self, program_id: str) -> None:
        conversation = self._conversations.pop(program_id, None)
        if conversation is None:
            return
        self.changes.mark(program_id)
        for key in conversation.keys:
            bucket = self._index[key]
            bucket.fresh.pop(program_id, None)
            bucket.continued.pop(program_id, None)
            if not bucket.fresh and not bucket.continued:
                del self._index[key]

    def _remember(self, program_id: str, conversation: _Conversation) -> None:
        self.forget(program_id)
        self._conversations[program_id] = conversation
        self._touch(program_id, conversation)
        for key in conversation.keys:
            self._index.setdefault(key, _Bucket()).fresh[program_id] = None
        while len(self._conversations) > self.remembered:
            self.forget(next(iter(self._conversations)))


def _opening(messages: list[Any], digests: list[bytes]) -> bytes:
    """The hash of what condensers keep: the first message and the first user message (the task)."""
    first_user = next(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
        0,
    )
    return _digest(digests[0], digests[first_user]) if digests else b""
