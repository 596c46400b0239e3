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

Pure and synchronous, in two halves: where a request is relayed it is hashed (`hash_turn`: the
cost that grows with its size); the index (`ConversationIndex`) only looks the hashes up, so the
scheduler's side never reads a request's text. A prompt takes one more step between them: the
index names the conversations it may continue, and the relay checks which it starts with.
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


@dataclass(frozen=True, slots=True)
class Claim:
    """One request's program, as the index found it."""

    program_id: str
    match: Match
    group: str | None = None  # a new program's: the hash of its first request, which its group shares


@dataclass(frozen=True, slots=True)
class ChatKeys:
    """A chat-like request's hashes as the index looks them up: the keys of the conversations it may
    continue, each kind in its order of preference, and the hash of all its messages (a new
    program's group)."""

    history: tuple[bytes, ...]  # its messages up to each assistant message, the latest first
    retried: tuple[bytes, ...]  # the requests it extends, the longest first
    rewritten: tuple[bytes, ...]  # its opening with its latest assistant message
    whole: bytes


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """A completions prompt's hashes as the index looks them up: the keys of its heads, its length in
    units and the hash of all of it (a new program's group)."""

    heads: tuple[bytes, ...]
    units: int
    whole: bytes


Keys = ChatKeys | PromptKeys


@dataclass(frozen=True, slots=True)
class Candidate:
    """A conversation a prompt may continue: the hash of its first `length` units, its program, and
    whether a request continued it already."""

    length: int
    digest: bytes
    program_id: str
    continued: bool


@dataclass(frozen=True, slots=True)
class Candidates:
    """What a prompt may start with: each program's last prompt and completion (`extended`), and its
    last prompt alone (`retried`)."""

    extended: tuple[Candidate, ...] = ()
    retried: tuple[Candidate, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptMatches:
    """The programs whose conversation a prompt starts with, the longest first: by their last prompt
    and completion, and by their last prompt alone."""

    extended: tuple[str, ...] = ()
    retried: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation as it stands after an answer (hashes only): the keys it is found under and, for
    completions, the units and hash of prompt + completion and of the prompt alone."""

    keys: tuple[bytes, ...]
    length: int = 0
    digest: bytes = b""
    prompt_length: int = 0
    prompt_digest: bytes = b""


class HashedChat:
    """A chat-like request's hashes, taken where it is relayed: what the index looks up (`keys`), and
    what its answer is remembered under."""

    def __init__(self, messages: list[Any]) -> None:
        chain, chains, digests = b"", [], []
        for message in messages:
            digests.append(message_digest(message))
            chain = _digest(chain, digests[-1])
            chains.append(chain)
        opening = _opening(messages, digests)
        assistants = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
        self.keys = ChatKeys(
            history=tuple(b"C" + chains[i] for i in reversed(assistants)),
            # Never the request itself: the same request again is a new sample of the same task, or a
            # resend, as for first requests.
            retried=tuple(b"R" + chains[i] for i in range(len(chains) - 2, -1, -1)),
            rewritten=(b"O" + _digest(opening, digests[assistants[-1]]),) if assistants else (),
            whole=chain,
        )
        self._opening = opening

    def answered(
        self, message: dict[str, Any] | None, text: str | None, token_ids: list[int] | None
    ) -> Conversation | None:
        """The conversation after this answer (an assistant message), None without one."""
        if message is None:
            return None
        answer = message_digest({"role": "assistant", **message})
        chain = self.keys.whole
        return Conversation((b"C" + _digest(chain, answer), b"O" + _digest(self._opening, answer), b"R" + chain))


class HashedPrompt:
    """A completions prompt's hashes (text, or token ids): what the index looks up (`keys`), which of
    the index's candidates it starts with, and what its answer is remembered under."""

    def __init__(self, units: bytes | memoryview, token_ids: bool) -> None:
        self._units, self._token_ids, self._width = units, token_ids, _width(token_ids)
        heads, self._hasher = _heads(units, self._width, token_ids)
        self.keys = PromptKeys(tuple(heads), len(units) // self._width, self._hasher.digest())

    def matches(self, candidates: Candidates) -> PromptMatches:
        return PromptMatches(self._prefixed(candidates.extended), self._prefixed(candidates.retried))

    def _prefixed(self, candidates: tuple[Candidate, ...]) -> tuple[str, ...]:
        """The candidates' programs whose prefix the prompt starts with, the longest first, up to the
        first one not continued yet (the index takes that one, unless another request took it since)."""
        by_length: dict[int, list[Candidate]] = {}
        for candidate in candidates:
            by_length.setdefault(candidate.length, []).append(candidate)
        matched: list[str] = []
        for length in sorted(by_length, reverse=True):
            digest = blake2b(memoryview(self._units)[: length * self._width], digest_size=DIGEST_BYTES).digest()
            found = [c for c in by_length[length] if c.digest == digest]
            matched.extend(c.program_id for c in found)
            if any(not c.continued for c in found):
                break
        return tuple(matched)

    def answered(
        self, message: dict[str, Any] | None, text: str | None, token_ids: list[int] | None
    ) -> Conversation | None:
        """Prompt + completion (the completion's token ids when the prompt was ids: without them, the
        prompt alone); None without a completion's text."""
        if text is None:
            return None
        hasher, units = self._hasher.copy(), self.keys.units
        completion = (_units(token_ids) if token_ids else None) if self._token_ids else _units(text)
        if completion is not None:
            hasher.update(completion[0])
            units += len(completion[0]) // self._width
        prompt = self.keys
        return Conversation((prompt.heads[-1],), units, hasher.digest(), prompt.units, prompt.whole)


Hashed = HashedChat | HashedPrompt


def hash_turn(turn: Turn) -> Hashed | None:
    """A request's identity hashes (None: one that cannot be followed, a batch of prompts): the
    relay's work, so that the index only looks keys up."""
    if turn.messages is not None:
        return HashedChat(turn.messages)
    found = _units(turn.prompt)
    return HashedPrompt(*found) if found is not None else None


@dataclass(frozen=True, slots=True)
class Followed:
    """A request's claim with its own hashes: what a relay holds until its answer ends."""

    claim: Claim
    hashed: Hashed

    @property
    def program_id(self) -> str:
        return self.claim.program_id

    @property
    def match(self) -> Match:
        return self.claim.match

    @property
    def group(self) -> str | None:
        return self.claim.group


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

    def claim(self, keys: Keys, matches: PromptMatches = PromptMatches()) -> Claim:
        """The program of the request with these hashes (and, for a prompt, these of its candidates
        that it starts with): the one it continues, or a new one."""
        if isinstance(keys, ChatKeys):
            program, match = self._first(keys.history), Match.HISTORY
            if program is None:
                program, match = self._first(keys.retried), Match.RETRIED
            if program is None:
                program, match = self._first(keys.rewritten), Match.REWRITTEN
        else:
            program, match = self._fresh_first(matches.extended), Match.HISTORY
            if program is None:
                program, match = self._fresh_first(matches.retried), Match.RETRIED
        claim = self._claimed(program, match, keys.whole)
        self.matched[claim.match] += 1
        return claim

    def candidates(self, keys: PromptKeys) -> Candidates:
        """The conversations under the prompt's heads that it may continue: those shorter than it (a
        prompt whose completion is unknown counts by its prompt alone)."""
        extended: list[Candidate] = []
        retried: list[Candidate] = []
        for head in keys.heads:
            bucket = self._index.get(head)
            for program in [*bucket.fresh, *bucket.continued] if bucket else []:
                c = self._conversations[program]
                if c.length < keys.units:
                    extended.append(Candidate(c.length, c.digest, program, c.continued))
                if 0 < c.prompt_length < min(keys.units, c.length):
                    retried.append(Candidate(c.prompt_length, c.prompt_digest, program, c.continued))
        return Candidates(tuple(extended), tuple(retried))

    def follow(self, turn: Turn) -> Followed | None:
        """Hash and claim at once, where one process holds both the relay's side and the index."""
        hashed = hash_turn(turn)
        if hashed is None:
            return None
        matches = hashed.matches(self.candidates(hashed.keys)) if isinstance(hashed, HashedPrompt) else PromptMatches()
        return Followed(self.claim(hashed.keys, matches), hashed)

    def answered(
        self, followed: Followed, message: dict[str, Any] | None = None, text: str | None = None,
        token_ids: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Remember the followed request's conversation as it stands after this answer."""
        conversation = followed.hashed.answered(message, text, token_ids)
        if conversation is not None:
            self.remember(followed.program_id, conversation)

    def _fresh_first(self, programs: tuple[str, ...]) -> str | None:
        """The first of these programs (still remembered) not continued yet, else the first continued."""
        remembered = [p for p in programs if p in self._conversations]
        fresh = (p for p in remembered if not self._conversations[p].continued)
        return next(fresh, remembered[0] if remembered else None)

    def _first(self, keys: tuple[bytes, ...]) -> str | None:
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

    def _claimed(self, program: str | None, match: Match, whole: bytes) -> Claim:
        if program is None:
            self._started += 1
            return Claim(f"conv-{self._prefix}-{self._started}", Match.NEW, f"first-{whole.hex()}")
        conversation = self._conversations[program]
        self._conversations.move_to_end(program)
        self._touch(program, conversation)
        if not conversation.continued:
            conversation.continued = True
            for key in conversation.keys:
                bucket = self._index[key]
                del bucket.fresh[program]
                bucket.continued[program] = None
        return Claim(program, match)

    # ---- its answer -----------------------------------------------------------------------

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

    def remember(self, program_id: str, remembered: Conversation) -> None:
        """The program's conversation as it stands after its answer, found by its next request."""
        self.forget(program_id)
        conversation = _Conversation(
            remembered.keys,
            remembered.length,
            remembered.digest,
            prompt_length=remembered.prompt_length,
            prompt_digest=remembered.prompt_digest,
        )
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
