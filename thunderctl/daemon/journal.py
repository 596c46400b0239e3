"""The daemon's journal: what its gateway must not lose when the daemon dies, in the state directory's
`journal.sqlite` (SQLite in WAL mode), written once a scheduler tick, and at each answer for what the
answer taught the gateway, and read back by the next daemon.

It holds every live program (the scheduler's snapshot: ids, workers, tokens, phases, groups, parents,
steps, each program's tool times) and what the laws learnt, the derived programs' conversations (hashes
only) and the Responses chains. A write is one transaction: a daemon killed at any moment leaves the
last whole write, never part of one. The scheduler's state is small (a row a program, a few hundred
samples); a tick encodes and writes only the rows of the programs changed since the last write
(compared on the event loop as tuples of their fields) and what the laws learnt; the conversations (up to
`remembered_conversations`) and the responses are written by their changes since the last write, at
the tick and before the end of each answer that changed them reaches its client (`keep`): an
unchanged client that has its answer is found again by the next daemon.

The gateway's state is read on the event loop (the scheduler is not thread-safe) and encoded and
written on a thread of the journal's own: requests are served meanwhile. docs/architecture.md
("Surviving a restart") says why SQLite and what a crash loses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thunderctl.gateway import Gateway
from thunderctl.gateway.chains import Kept
from thunderctl.gateway.identity import IndexSnapshot, Remembered
from thunderctl.gateway.restored import Restored
from thunderctl.scheduler.snapshot import SchedulerSnapshot

log = logging.getLogger(__name__)

# What the tables hold and how: a journal of another version is not read (the daemon starts empty).
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS programs (id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS conversations (
    program_id TEXT PRIMARY KEY, touched INTEGER NOT NULL, keys BLOB NOT NULL,
    length INTEGER NOT NULL, digest BLOB NOT NULL, continued INTEGER NOT NULL,
    prompt_length INTEGER NOT NULL DEFAULT 0, prompt_digest BLOB NOT NULL DEFAULT x''
);
CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, touched INTEGER NOT NULL, record TEXT NOT NULL);
"""
# Columns of `conversations` added since version 1, as SCHEMA declares them.
ADDED_COLUMNS = {"prompt_length": "INTEGER NOT NULL DEFAULT 0", "prompt_digest": "BLOB NOT NULL DEFAULT x''"}


@dataclass
class Capture:
    """What one write takes from the gateway, read on the event loop."""

    # None: an answers' write (`keep`), of the conversations and chains alone.
    scheduler: SchedulerSnapshot | None
    written_at: float  # wall clock: a later daemon's clock may be another
    derived: list[str]
    index: tuple[str, int] | None  # the conversation index's id prefix and count, with derivation on
    conversations: list[Remembered]
    forgotten_conversations: list[str]
    responses: list[tuple[str, Kept]]
    forgotten_responses: list[str]
    whole: bool  # conversations and responses are all of them, not changes: the tables are rewritten
    # An answers' write's programs, in their state after the answer (the scheduler's whole state
    # waits for the tick).
    answered: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class JournalStats:
    """What the journal wrote: `status --json` shows it under the daemon."""

    writes: int = 0
    written_at: float | None = None  # wall clock of the state last written
    capture_ms: float = 0.0  # the last write's time on the event loop
    write_ms: float = 0.0  # and on the journal's thread
    failures: int = 0
    restored_programs: int = 0  # programs this daemon took back from the journal at its start
    programs: int = 0
    conversations: int = 0
    responses: int = 0
    programs_written: int = 0  # by the last tick's write: the programs changed since the write before


@dataclass
class Journal:
    path: Path
    stats: JournalStats = field(default_factory=JournalStats)
    # Each program's state (snapshot.py `program_state`) as last written; None: its row is written,
    # in a state not known here (read back, or an answer's write), and is written again at the tick.
    _written: dict[str, tuple[Any, ...] | None] = field(default_factory=dict)
    _learnt: str = ""  # the learnt state as last written
    _whole: bool = True  # the next write rewrites the conversations and responses whole
    _asked: int = 0  # answers that asked to be kept (`keep`), and how many of them are
    _kept: int = 0
    _answered: set[str] = field(default_factory=set)  # the programs of the answers not yet kept

    def __post_init__(self) -> None:
        # One thread writes, in the order the writes were taken: the connection is used by it alone
        # once the daemon runs, and a later state is never overwritten by an earlier one.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._keeping = asyncio.Lock()
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:  # not a database: the daemon starts, without it
            log.warning("journal %s unreadable (%s); moved to %s", self.path, exc, self.set_aside())

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL loses no commit to a process that dies (only to a power cut) and syncs at
        # checkpoints only: a write costs no fsync.
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        # A journal written before a column was added gets it, with its default: what its rows did not know.
        columns = {row[1] for row in db.execute("PRAGMA table_info(conversations)")}
        for column, declaration in ADDED_COLUMNS.items():
            if column not in columns:
                db.execute(f"ALTER TABLE conversations ADD COLUMN {column} {declaration}")
        return db

    def set_aside(self) -> Path:
        """Move the journal's files aside (for a look) and start a new one; where they went."""
        if hasattr(self, "_db"):
            self._db.close()
        aside = self.path.with_name(self.path.name + ".bad")
        for suffix in ("", "-wal", "-shm"):
            moved = Path(f"{self.path}{suffix}")
            if moved.exists():
                moved.replace(f"{aside}{suffix}")
        self._written, self._learnt, self._whole = {}, "", True
        self._db = self._open()
        return aside

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._db.close()

    # ---- reading it back -------------------------------------------------------------------

    def load(self) -> Restored | None:
        """What the last daemon wrote, or None where it wrote nothing this daemon can read (then it is
        moved aside)."""
        try:
            return self._read()
        except (sqlite3.Error, ValueError, KeyError, TypeError) as exc:
            log.warning("journal %s unreadable (%s); moved to %s", self.path, exc, self.set_aside())
            return None

    def _read(self) -> Restored | None:
        meta = dict(self._db.execute("SELECT key, value FROM meta"))
        if "scheduler" not in meta:
            return None
        if meta.get("version") != str(SCHEMA_VERSION):
            raise ValueError(f"of version {meta.get('version')}, not {SCHEMA_VERSION}")
        programs = []
        for program_id, record in self._db.execute("SELECT id, record FROM programs"):
            self._written[program_id] = None
            programs.append(json.loads(record))
        self._learnt = meta["learnt"]
        taken_at = json.loads(meta["scheduler"])["taken_at"]
        index = json.loads(meta["index"])
        rows = self._db.execute(
            "SELECT program_id, touched, keys, length, digest, continued, prompt_length, prompt_digest"
            " FROM conversations"
        )
        conversations = [
            Remembered(program_id, _keys(keys), length, digest, bool(continued), touched, prompt_length, prompt_digest)
            for program_id, touched, keys, length, digest, continued, prompt_length, prompt_digest in rows
        ]
        responses = [
            (response_id, Kept(**json.loads(record), touched=touched))
            for response_id, touched, record in self._db.execute("SELECT id, touched, record FROM responses")
        ]
        self.stats.restored_programs = len(programs)
        self._whole = False  # the tables hold what is restored: the changes from it are what to write
        return Restored(
            SchedulerSnapshot(taken_at, programs, json.loads(meta["learnt"])),
            elapsed_s=max(0.0, time.time() - float(meta["written_at"])),
            derived=json.loads(meta["derived"]),
            conversations=IndexSnapshot(index[0], index[1], conversations) if index is not None else None,
            responses=responses,
        )

    # ---- writing it ------------------------------------------------------------------------

    def follow(self, gateway: Gateway) -> None:
        """Keep track of the changes of the gateway's large stores from now on."""
        if gateway.derived.conversations is not None:
            gateway.derived.conversations.changes.follow()
        gateway.chains.changes.follow()

    async def run(self, gateway: Gateway, interval_s: float) -> None:
        """Write now, then every `interval_s` (the scheduler's tick) until cancelled, and the answers'
        conversations and chains as they come (`keep`); a failed write is logged and the next
        writes everything again."""
        self.follow(gateway)
        gateway.keep_answers = lambda program_id: self.keep(gateway, program_id)
        while True:
            await self.write(gateway)
            await asyncio.sleep(interval_s)

    async def keep(self, gateway: Gateway, program_id: str | None) -> None:
        """Write the conversations and chains changed so far, with the program of each answer that
        asked, and return once they are written (or the write failed). The answers that ask while a
        write runs share the next one: one transaction for all of them, however many end at once."""
        if program_id is not None:
            self._answered.add(program_id)
        self._asked += 1
        asked = self._asked
        async with self._keeping:
            if self._kept >= asked:
                return  # written by the write this one waited for
            covered = self._asked
            capture = self.capture_answers(gateway)
            try:
                await asyncio.get_running_loop().run_in_executor(self._thread, self._write_answers, capture)
            except (sqlite3.Error, RuntimeError) as exc:  # RuntimeError: the journal closed under it
                self.stats.failures += 1
                self._whole = True
                log.warning("journal %s not written: %s", self.path, exc)
            self._kept = covered

    async def write(self, gateway: Gateway) -> None:
        started = time.perf_counter()
        capture = self.capture(gateway)
        self.stats.capture_ms = 1000 * (time.perf_counter() - started)
        started = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._write, capture)
        except sqlite3.Error as exc:
            self.stats.failures += 1
            self._whole = True  # the changes taken are not in the journal: the next write has them all
            log.warning("journal %s not written: %s", self.path, exc)
            return
        self.stats.write_ms = 1000 * (time.perf_counter() - started)
        self.stats.writes += 1
        self.stats.written_at = capture.written_at

    def capture(self, gateway: Gateway) -> Capture:
        """The gateway's state now: the programs changed since the last write and what the laws
        learnt, and the changes since the last capture of the conversations and the responses (all
        of them at the first, or after a failed write)."""
        whole, self._whole = self._whole, False
        # `_written` changes on the journal's thread, and only after a commit: a program it shows
        # in a state is in the journal in that state, so reading it meanwhile skips no change.
        return self._capture(gateway, gateway.scheduler.snapshot(since=self._written), whole)

    def capture_answers(self, gateway: Gateway) -> Capture:
        """The conversations and responses changed since the last capture, and the programs answered."""
        capture = self._capture(gateway, None, whole=False)
        capture.answered = gateway.scheduler.program_records(self._answered)
        self._answered = set()
        return capture

    def _capture(self, gateway: Gateway, scheduler: SchedulerSnapshot | None, whole: bool) -> Capture:
        index = gateway.derived.conversations
        if index is None:
            conversations: list[Remembered] = []
            forgotten: list[str] = []
        elif whole:
            index.changes.take()
            conversations, forgotten = index.snapshot().conversations, []
        else:
            conversations, forgotten = index.changed()
        if whole:
            gateway.chains.changes.take()
            responses, forgotten_responses = gateway.chains.snapshot(), []
        else:
            responses, forgotten_responses = gateway.chains.changed()
        return Capture(
            scheduler, time.time(), gateway.derived.ids(), (index.numbering() if index is not None else None),
            conversations, forgotten, responses, forgotten_responses, whole,
        )  # fmt: skip

    def _write(self, capture: Capture) -> None:
        """One transaction: the scheduler's changed rows, the changes of the other stores, the meta rows."""
        assert capture.scheduler is not None
        states = capture.scheduler.states
        changed = [(p["id"], json.dumps(p, separators=(",", ":"))) for p in capture.scheduler.programs]
        gone = [(i,) for i in self._written.keys() - states.keys()]
        learnt = json.dumps(capture.scheduler.learnt, separators=(",", ":"))
        meta = {
            "version": str(SCHEMA_VERSION),
            "scheduler": json.dumps({"taken_at": capture.scheduler.taken_at}),
            "written_at": repr(capture.written_at),
            "derived": json.dumps(capture.derived),
            "index": json.dumps(capture.index),
        }
        if learnt != self._learnt:
            meta["learnt"] = learnt
        with self._transaction() as db:
            db.executemany("DELETE FROM programs WHERE id = ?", gone)
            db.executemany("INSERT OR REPLACE INTO programs VALUES (?, ?)", changed)
            self._write_stores(db, capture)
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", meta.items())
        self._written = dict(states)
        self._learnt = learnt
        self.stats.programs, self.stats.programs_written = len(states), len(changed)
        self.stats.conversations = self._db.execute("SELECT count(*) FROM conversations").fetchone()[0]
        self.stats.responses = self._db.execute("SELECT count(*) FROM responses").fetchone()[0]

    def _write_answers(self, capture: Capture) -> None:
        """One transaction: the answered programs' rows (their times in the scheduler's clock, as the
        last whole write's are), the conversations' and responses' changes, and the index's
        numbering (so that the next daemon derives no id this one gave out)."""
        records = {p["id"]: json.dumps(p, separators=(",", ":")) for p in capture.answered}
        with self._transaction() as db:
            db.executemany("INSERT OR REPLACE INTO programs VALUES (?, ?)", records.items())
            self._write_stores(db, capture)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('index', ?)", (json.dumps(capture.index),))
        self._written.update(dict.fromkeys(records))

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._db
        db.execute("BEGIN")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    @staticmethod
    def _write_stores(db: sqlite3.Connection, capture: Capture) -> None:
        if capture.whole:
            db.execute("DELETE FROM conversations")
            db.execute("DELETE FROM responses")
        db.executemany("DELETE FROM conversations WHERE program_id = ?", _rows(capture.forgotten_conversations))
        db.executemany("INSERT OR REPLACE INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (_conversation_row(c) for c in capture.conversations))  # fmt: skip
        db.executemany("DELETE FROM responses WHERE id = ?", _rows(capture.forgotten_responses))
        db.executemany("INSERT OR REPLACE INTO responses VALUES (?, ?, ?)",
                       (_response_row(i, k) for i, k in capture.responses))  # fmt: skip


def _rows(ids: Iterable[str]) -> Iterable[tuple[str]]:
    return ((i,) for i in ids)


def _conversation_row(c: Remembered) -> tuple[Any, ...]:
    keys = b"".join(bytes([len(key)]) + key for key in c.keys)  # each key after its length
    return c.program_id, c.touched, keys, c.length, c.digest, int(c.continued), c.prompt_length, c.prompt_digest


def _keys(joined: bytes) -> tuple[bytes, ...]:
    keys, at = [], 0
    while at < len(joined):
        length = joined[at]
        keys.append(joined[at + 1 : at + 1 + length])
        at += 1 + length
    return tuple(keys)


def _response_row(response_id: str, kept: Kept) -> tuple[str, int, str]:
    record = {"program_id": kept.program_id, "previous": kept.previous, "input": kept.input, "response": kept.response}
    return response_id, kept.touched, json.dumps(record, separators=(",", ":"))
