"""The state a restarted daemon takes back, as plain data: the scheduler's (programs and what its laws
learnt), the conversation index's and the Responses chains' snapshots and their round trips, pure (no
processes, no I/O), and the daemon's journal written and read back on disk."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from thunderctl.daemon.journal import Journal
from thunderctl.gateway import Gateway, WorkerLink
from thunderctl.gateway.chains import ResponseChains
from thunderctl.gateway.identity import ConversationIndex, Match, Turn
from thunderctl.scheduler import Phase, Scheduler, SchedulerConfig, Status
from thunderctl.sim.clock import VirtualClock

CONFIG = SchedulerConfig(**{"admission.buffer_tokens": 0, "retention.tool_time_min_samples": 2})
SYSTEM = {"role": "system", "content": "You are a careful software engineer."}
TASK = {"role": "user", "content": "Fix the failing test in utils.py"}


def scheduler(clock: VirtualClock, workers: tuple[str, ...] = ("a", "b"), capacity: int = 10_000) -> Scheduler:
    sched = Scheduler(CONFIG, clock)
    for worker in workers:
        sched.add_worker(worker, capacity)
    return sched


def busy_scheduler(clock: VirtualClock) -> Scheduler:
    """Programs in every state a tick leaves them in, with tool times, groups, a parent, ended ones."""
    sched = scheduler(clock)
    for step in range(4):
        for i in range(6):
            program = f"p{i}"
            sched.on_request(program, 500 + 100 * i + 40 * step, group="g0" if i < 3 else "g1",
                             parent="p0" if i == 5 else None)  # fmt: skip
            clock.now += 0.5
            sched.on_response(program, 500 + 100 * i + 40 * step, 20, tool="bash" if i % 2 else "edit")
        clock.now += 3.0
        sched.adapt(0.9)
        sched.tick()
    sched.release("p4")
    sched.drain("b")  # its programs pause, to resume on a
    return sched


def test_a_scheduler_restored_from_its_snapshot_holds_the_same_programs_charges_and_learnt_laws() -> None:
    clock = VirtualClock(1000.0)
    before = busy_scheduler(clock)
    snapshot = before.snapshot()
    after = scheduler(clock)
    after.restore(snapshot)

    assert after.snapshot() == snapshot
    assert [after.reserved_tokens(w) for w in ("a", "b")] == [before.reserved_tokens(w) for w in ("a", "b")]
    assert after.groups.counts() == before.groups.counts()
    assert [p.id for p in after.resume_queue()] == [p.id for p in before.resume_queue()]
    program = after.programs["p1"]
    assert after.ending.ends_after_s(program, after.retention.tool_times) == before.ending.ends_after_s(
        before.programs["p1"], before.retention.tool_times
    )


def test_a_snapshot_survives_json_as_the_journal_stores_it() -> None:
    clock = VirtualClock(1000.0)
    snapshot = busy_scheduler(clock).snapshot()
    stored = json.loads(json.dumps({"programs": snapshot.programs, "learnt": snapshot.learnt}))
    after = scheduler(clock)
    after.restore(type(snapshot)(snapshot.taken_at, stored["programs"], stored["learnt"]))
    assert after.snapshot() == snapshot


def test_a_restored_program_keeps_its_silence_through_the_time_the_daemon_was_down() -> None:
    clock = VirtualClock(1000.0)
    before = busy_scheduler(clock)
    silent_s = clock.now - before.programs["p1"].last_activity
    later = VirtualClock(50.0)  # another process's clock: its zero is elsewhere
    after = scheduler(later)
    after.restore(before.snapshot(), elapsed_s=12.0)
    assert later.now - after.programs["p1"].last_activity == silent_s + 12.0


def test_requests_in_flight_or_waiting_at_the_snapshot_are_gone_their_programs_act() -> None:
    clock = VirtualClock(1000.0)
    before = scheduler(clock, ("a",), capacity=1_000)
    assert before.on_request("running", 600) == "a"
    assert before.on_request("waiting", 600) is None  # no room: it waits
    after = scheduler(clock, ("a",), capacity=1_000)
    after.restore(before.snapshot())

    running, waiting = after.programs["running"], after.programs["waiting"]
    assert (running.status, running.phase, running.worker) == (Status.ACTIVE, Phase.ACTING, "a")
    assert (waiting.status, waiting.waiting_since) == (Status.PAUSED, None)
    assert after.on_request("running", 650) == "a"  # its client's retry goes where its KV is


def test_a_program_on_a_worker_the_new_scheduler_lacks_is_paused_not_lost() -> None:
    clock = VirtualClock(1000.0)
    before = scheduler(clock)
    before.on_request("p", 500)
    before.on_response("p", 500, 10)
    worker = before.programs["p"].worker
    after = scheduler(clock, tuple({"a", "b"} - {worker}))
    after.restore(before.snapshot())
    assert after.programs["p"].status is Status.PAUSED and after.programs["p"].steps == 1


def test_a_restored_index_finds_the_next_request_of_each_conversation_and_numbers_new_ones_on() -> None:
    before = ConversationIndex(100)
    claims = {}
    for n in range(3):
        task = {"role": "user", "content": f"task {n}"}
        claim = before.follow(Turn(messages=[SYSTEM, task]))
        assert claim is not None
        before.answered(claim, message={"content": f"answer {n}"})
        claims[n] = claim.program_id
    after = ConversationIndex(100)
    after.restore(before.snapshot())

    task = {"role": "user", "content": "task 1"}
    again = after.follow(Turn(messages=[SYSTEM, task, {"role": "assistant", "content": "answer 1"}, TASK]))
    new = after.follow(Turn(messages=[SYSTEM, {"role": "user", "content": "another task"}]))
    assert again is not None and (again.program_id, again.match) == (claims[1], Match.HISTORY)
    assert new is not None and new.match is Match.NEW and new.program_id not in claims.values()
    assert after.snapshot().prefix == before.snapshot().prefix


def test_a_restored_index_forgets_in_the_order_the_old_one_would_have() -> None:
    before = ConversationIndex(3)
    ids = []
    for n in range(3):
        claim = before.follow(Turn(prompt=f"prompt number {n}"))
        assert claim is not None
        before.answered(claim, text=f" and {n}", token_ids=None)
        ids.append(claim.program_id)
    assert before.follow(Turn(prompt="prompt number 0 and 0 more")).program_id == ids[0]  # continued: the newest now
    after = ConversationIndex(3)
    after.restore(before.snapshot())
    claim = after.follow(Turn(prompt="something else entirely"))
    assert claim is not None
    after.answered(claim, text="!", token_ids=None)  # a fourth: the least recently continued goes
    assert {r.program_id for r in after.snapshot().conversations} == {ids[0], ids[2], claim.program_id}


def test_an_index_followed_by_a_journal_names_what_changed_since_it_last_asked() -> None:
    index = ConversationIndex(2)
    first = index.follow(Turn(prompt="first prompt"))
    assert first is not None
    index.answered(first, text="x", token_ids=None)
    index.changes.follow()
    assert index.changed() == ([], [])
    for prompt in ("second prompt", "third prompt"):  # the third pushes the first out
        claim = index.follow(Turn(prompt=prompt))
        assert claim is not None
        index.answered(claim, text="x", token_ids=None)
    changed, forgotten = index.changed()
    assert len(changed) == 2 and forgotten == [first.program_id]
    assert index.changed() == ([], [])


def test_restored_chains_keep_their_turns_and_their_order_of_forgetting() -> None:
    before = ResponseChains(limit=2)
    before.keep("p", None, [{"role": "user", "content": "one"}], {"id": "r1", "output": []})
    before.keep("p", "r1", [{"role": "user", "content": "two"}], {"id": "r2", "output": []})
    before.get("r1")  # read: the newest now
    after = ResponseChains(limit=2)
    after.restore(before.snapshot())
    assert after.items("r2") == before.items("r2")
    after.keep("q", None, [], {"id": "r3", "output": []})
    assert after.get("r2") is None and after.get("r1") is not None


def gateway(clock: VirtualClock) -> Gateway:
    return Gateway([WorkerLink("a", "http://127.0.0.1:9"), WorkerLink("b", "http://127.0.0.1:9")], CONFIG, clock)


def test_the_journal_reads_back_what_it_wrote_whole_then_by_changes(tmp_path: Path) -> None:
    clock = VirtualClock(1000.0)
    source = gateway(clock)
    source.scheduler = busy_scheduler(clock)
    index = source.derived.conversations
    assert index is not None
    claims = []
    for n in range(3):
        claim = asyncio.run(source.relay.follow(Turn(messages=[SYSTEM, {"role": "user", "content": f"task {n}"}])))
        assert claim is not None
        index.answered(claim, message={"content": f"answer {n}"})
        claims.append(claim)
    source.chains.keep("p1", None, [{"role": "user", "content": "hi"}], {"id": "r1", "output": []})
    journal = Journal(tmp_path / "journal.sqlite")

    async def write_twice() -> None:
        journal.follow(source)
        await journal.write(source)  # whole
        index.forget(claims[0].program_id)  # then changes: one forgotten, one continued and answered
        claim = await source.relay.follow(Turn(messages=[SYSTEM, {"role": "user", "content": "task 1"},
                                                         {"role": "assistant", "content": "answer 1"}, TASK]))  # fmt: skip
        assert claim is not None and claim.program_id == claims[1].program_id
        index.answered(claim, message={"content": "answer 1b"})
        source.scheduler.release("p3")
        await journal.write(source)

    asyncio.run(write_twice())
    journal.close()
    reader = Journal(tmp_path / "journal.sqlite")
    restored = reader.load()
    reader.close()
    assert restored is not None
    assert restored.scheduler.programs == source.scheduler.snapshot().programs
    assert restored.scheduler.learnt == source.scheduler.snapshot().learnt
    assert restored.conversations is not None and index is not None
    assert sorted(restored.conversations.conversations, key=lambda r: r.touched) == sorted(
        index.snapshot().conversations, key=lambda r: r.touched
    )
    assert [(i, k.response) for i, k in restored.responses] == [(i, k.response) for i, k in source.chains.snapshot()]
    assert sorted(restored.derived) == sorted(source.derived.ids())


def test_a_ticks_journal_write_writes_only_the_programs_changed_since_and_reads_back_as_they_are(
    tmp_path: Path,
) -> None:
    clock = VirtualClock(1000.0)
    source = gateway(clock)
    source.scheduler = busy_scheduler(clock)
    journal = Journal(tmp_path / "journal.sqlite")

    async def write_three_times() -> list[int]:
        journal.follow(source)
        await journal.write(source)  # all of them
        written = [journal.stats.programs_written]
        await journal.write(source)  # none changed
        written.append(journal.stats.programs_written)
        clock.now += 2.0
        source.scheduler.on_request("p1", 900)  # p1 leaves its tool call and takes a step
        clock.now += 0.5
        source.scheduler.on_response("p1", 900, 20, tool="bash")
        await journal.write(source)
        return [*written, journal.stats.programs_written]

    assert asyncio.run(write_three_times()) == [len(source.scheduler.programs), 0, 1]
    journal.close()
    reader = Journal(tmp_path / "journal.sqlite")
    restored = reader.load()
    reader.close()
    assert restored is not None
    by_id = sorted(restored.scheduler.programs, key=lambda record: record["id"])
    assert by_id == sorted(source.scheduler.snapshot().programs, key=lambda record: record["id"])


def test_a_journal_that_is_not_a_database_is_set_aside_and_the_daemon_starts_without_it(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    path.write_bytes(b"not a database at all, but long enough to be read as a header" * 4)
    journal = Journal(path)
    assert journal.load() is None
    journal.close()
    assert (tmp_path / "journal.sqlite.bad").read_bytes().startswith(b"not a database")


def write_journal(source: Gateway, path: Path) -> None:
    journal = Journal(path)
    journal.follow(source)
    asyncio.run(journal.write(source))
    journal.close()


def index_read_back(path: Path) -> ConversationIndex:
    """The conversations of the journal at `path`, in a new daemon's index."""
    reader = Journal(path)
    restored = reader.load()
    reader.close()
    assert restored is not None and restored.conversations is not None
    index = ConversationIndex(100)
    index.restore(restored.conversations)
    return index


def completed_once(prompt: list[int], completion: list[int]) -> tuple[Gateway, str]:
    """A gateway that relayed one completions request and its answer; that request's program."""
    source = gateway(VirtualClock(1000.0))
    claim = asyncio.run(source.relay.follow(Turn(prompt=prompt)))
    assert claim is not None and source.derived.conversations is not None
    source.derived.conversations.answered(claim, text="", token_ids=completion)
    return source, claim.program_id


def test_a_completion_retried_without_its_answer_after_a_restart_continues_its_program(tmp_path: Path) -> None:
    source, program = completed_once([1, 2, 3], [4])
    write_journal(source, tmp_path / "journal.sqlite")
    retried = index_read_back(tmp_path / "journal.sqlite").follow(Turn(prompt=[1, 2, 3, 9]))
    assert retried is not None and (retried.program_id, retried.match) == (program, Match.RETRIED)


def test_a_journal_written_before_prompts_were_kept_is_read_and_its_conversations_go_on(tmp_path: Path) -> None:
    source, program = completed_once([1, 2, 3], [4])
    path = tmp_path / "journal.sqlite"
    write_journal(source, path)
    with sqlite3.connect(path) as db:  # as a daemon before those columns left it
        db.execute("ALTER TABLE conversations DROP COLUMN prompt_length")
        db.execute("ALTER TABLE conversations DROP COLUMN prompt_digest")
    follow = index_read_back(path).follow(Turn(prompt=[1, 2, 3, 4, 5]))
    assert follow is not None and (follow.program_id, follow.match) == (program, Match.HISTORY)
