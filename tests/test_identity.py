"""Program identity from the conversation (thunderctl/gateway/identity.py): which program an unnamed
request continues, however a client echoes the answer it got back."""

from __future__ import annotations

import json
from typing import Any

from thunderctl.gateway.identity import ConversationIndex, Followed, Match, Turn

SYSTEM = {"role": "system", "content": "You are a careful software engineer."}
TASK = {"role": "user", "content": "Fix the failing test in utils.py"}
ANSWER = {
    "role": "assistant",
    "content": "Let me look.\n\n```bash\ncat utils.py\n```",
    "reasoning_content": "The test fails; read the file first.",
}
CALL_ANSWER = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "cat utils.py", "timeout": 30}'},
        }
    ],
}
OBSERVATION = {"role": "user", "content": "def add(a, b): return a - b"}


def answered(index: ConversationIndex, messages: list[dict[str, Any]], answer: dict[str, Any]) -> str:
    """Send a chat request and its answer through the index; the program it belonged to."""
    claim = index.follow(Turn(messages=messages))
    assert claim is not None
    index.answered(claim, message=answer)
    return claim.program_id


def program_of(index: ConversationIndex, messages: list[dict[str, Any]]) -> str:
    claim = index.follow(Turn(messages=messages))
    assert claim is not None
    return claim.program_id


def completed(
    index: ConversationIndex, prompt: str | list[int], text: str, token_ids: list[int] | None = None
) -> Followed:
    """Send a completions request and its answer through the index; its claim."""
    claim = index.follow(Turn(prompt=prompt))
    assert claim is not None
    index.answered(claim, text=text, token_ids=token_ids)
    return claim


def started(index: ConversationIndex, answer: dict[str, Any] = ANSWER) -> str:
    return answered(index, [SYSTEM, TASK], answer)


def test_a_request_that_extends_a_relayed_answer_continues_its_program() -> None:
    index = ConversationIndex(100)
    program = started(index)
    assert program_of(index, [SYSTEM, TASK, ANSWER, OBSERVATION]) == program


def test_a_request_that_continues_nothing_starts_a_new_program() -> None:
    index = ConversationIndex(100)
    program = started(index)
    other = {"role": "user", "content": "Another task"}
    assert program_of(index, [SYSTEM, other, ANSWER | {"content": "something else"}, OBSERVATION]) != program
    assert program_of(index, [SYSTEM, other]) != program


def test_whitespace_around_and_inside_an_echoed_answer_still_matches() -> None:
    index = ConversationIndex(100)
    program = started(index)
    echoed = ANSWER | {"content": "  Let me look.\n```bash\n  cat   utils.py\n```\n"}
    assert program_of(index, [SYSTEM, TASK, echoed, OBSERVATION]) == program


def test_content_sent_back_as_a_list_of_parts_still_matches() -> None:
    index = ConversationIndex(100)
    program = started(index)
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in (SYSTEM, TASK, ANSWER, OBSERVATION)]
    assert program_of(index, parts) == program


def test_tool_call_arguments_re_serialised_still_match() -> None:
    index = ConversationIndex(100)
    program = started(index, CALL_ANSWER)
    call = CALL_ANSWER["tool_calls"][0]
    arguments = json.dumps(json.loads(call["function"]["arguments"]), indent=2, sort_keys=True)
    echoed = CALL_ANSWER | {"tool_calls": [call | {"function": call["function"] | {"arguments": arguments}}]}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "def add(a, b): return a - b"}
    assert program_of(index, [SYSTEM, TASK, echoed, tool]) == program


def test_name_fields_added_by_the_client_still_match() -> None:
    index = ConversationIndex(100)
    program = started(index)
    named = [m | {"name": "agent"} for m in (SYSTEM, TASK, ANSWER, OBSERVATION)]
    assert program_of(index, named) == program


def test_an_answer_echoed_without_its_reasoning_still_matches() -> None:
    index = ConversationIndex(100)
    program = started(index)
    plain = {k: v for k, v in ANSWER.items() if k != "reasoning_content"}
    assert program_of(index, [SYSTEM, TASK, plain, OBSERVATION]) == program


def test_a_condensed_history_continues_while_its_latest_answer_is_the_programs() -> None:
    index = ConversationIndex(100)
    program = started(index)
    second = {"role": "assistant", "content": "```bash\nsed -i s/-/+/ utils.py\n```"}
    assert answered(index, [SYSTEM, TASK, ANSWER, OBSERVATION], second) == program
    summary = {"role": "user", "content": "Summary: the file subtracts instead of adding."}
    condensed = [SYSTEM, TASK, summary, second, {"role": "user", "content": "done"}]
    claim = index.follow(Turn(messages=condensed))
    assert claim is not None and (claim.program_id, claim.match) == (program, Match.REWRITTEN)


def test_n_identical_first_requests_stay_n_programs_though_their_answers_coincide() -> None:
    index = ConversationIndex(100)
    group = [started(index) for _ in range(4)]  # a GRPO group: one task, four samples, the same answer
    assert len(set(group)) == 4
    continued = [program_of(index, [SYSTEM, TASK, ANSWER, {"role": "user", "content": f"try {i}"}]) for i in range(4)]
    assert sorted(continued) == sorted(group)


def test_a_request_sent_again_stays_with_its_program() -> None:
    index = ConversationIndex(100)
    program = started(index)
    again = [SYSTEM, TASK, ANSWER, OBSERVATION]
    assert program_of(index, again) == program
    assert program_of(index, again) == program  # a retry of a request whose answer never came


def test_a_completions_prompt_that_extends_prompt_and_completion_continues_its_program() -> None:
    index = ConversationIndex(100)
    claim = completed(index, "Task: fix utils.py\nThought:", " read the file\nAction: cat utils.py\n")
    follow = index.follow(Turn(prompt="Task: fix utils.py\nThought: read the file\nAction: cat utils.py\nObs: ok\n"))
    assert follow is not None and follow.program_id == claim.program_id


def test_a_token_id_prompt_that_extends_prompt_and_completion_ids_continues_its_program() -> None:
    index = ConversationIndex(100)
    prompts = [list(range(1000 * k, 1000 * k + 300)) for k in range(3)]
    claims = [completed(index, p, "", [7, 8, 9]) for p in prompts]
    follow = index.follow(Turn(prompt=[*prompts[1], 7, 8, 9, 42, 43]))
    assert follow is not None and follow.program_id == claims[1].program_id != claims[0].program_id


def test_a_token_id_prompt_whose_completion_ids_are_unknown_continues_by_its_prompt() -> None:
    index = ConversationIndex(100)
    claim = completed(index, list(range(50)), "text only")
    follow = index.follow(Turn(prompt=[*range(50), 99, 98]))
    assert follow is not None and follow.program_id == claim.program_id


def test_a_completion_that_does_not_extend_the_earlier_prompt_starts_a_new_program() -> None:
    index = ConversationIndex(100)
    claim = completed(index, "Task: fix utils.py\nThought:", " read the file")
    other = index.follow(Turn(prompt="Task: fix utils.py\nAction: write a test first"))
    assert other is not None and other.match is Match.NEW and other.program_id != claim.program_id


def test_a_text_prompt_that_extends_the_last_prompt_without_its_completion_continues_its_program() -> None:
    index = ConversationIndex(100)
    claim = completed(index, "Task: fix utils.py\nThought:", " I will guess")  # dropped: it did not parse
    retried = index.follow(Turn(prompt="Task: fix utils.py\nThought:\nFormat error: say Action.\nThought:"))
    assert retried is not None and (retried.program_id, retried.match) == (claim.program_id, Match.RETRIED)


def test_token_ids_that_re_tokenize_the_completion_continue_the_program_of_their_prompt() -> None:
    index = ConversationIndex(100)
    prompts = [list(range(1000 * k, 1000 * k + 300)) for k in range(3)]
    claims = [completed(index, p, "", [7, 8, 9]) for p in prompts]
    follow = index.follow(Turn(prompt=[*prompts[2], 7, 89, 42, 43]))  # the trainer's ids for "7 8 9"
    assert follow is not None and (follow.program_id, follow.match) == (claims[2].program_id, Match.RETRIED)


def test_a_prompt_that_extends_prompt_and_completion_wins_over_a_longer_prompt_alone() -> None:
    index = ConversationIndex(100)
    longer = completed(index, [1, 2, 3, 4], "", [50])
    shorter = completed(index, [1, 2], "", [3])
    follow = index.follow(Turn(prompt=[1, 2, 3, 4, 6]))
    assert follow is not None and (follow.program_id, follow.match) == (shorter.program_id, Match.HISTORY)
    assert longer.program_id != shorter.program_id


def test_samples_that_all_drop_their_completions_stay_one_program_each() -> None:
    index = ConversationIndex(100)
    programs = {completed(index, [5] * 40, "", [k]).program_id for k in range(4)}
    retried = {completed(index, [5] * 40 + [99], "", [1]).program_id for _ in range(4)}
    assert len(programs) == 4 and retried == programs


def test_memory_holds_the_most_recently_continued_conversations_only() -> None:
    index = ConversationIndex(3)
    tasks = [{"role": "user", "content": f"task {i}"} for i in range(4)]
    programs = [answered(index, [SYSTEM, task], ANSWER) for task in tasks[:3]]
    # The first is continued, so the second is now the least recently continued.
    assert answered(index, [SYSTEM, tasks[0], ANSWER, OBSERVATION], ANSWER) == programs[0]
    answered(index, [SYSTEM, tasks[3]], ANSWER)
    assert len(index) == 3
    assert program_of(index, [SYSTEM, tasks[1], ANSWER, OBSERVATION]) not in programs
    assert program_of(index, [SYSTEM, tasks[0], ANSWER, OBSERVATION, ANSWER, OBSERVATION]) == programs[0]


def test_a_batch_of_prompts_is_not_followed() -> None:
    assert ConversationIndex(10).follow(Turn(prompt=["one", "two"])) is None


def test_a_batch_of_one_prompt_is_followed_as_that_prompt() -> None:
    index = ConversationIndex(10)
    claim = completed(index, ["Task: fix it\nThought:"], " read")
    follow = index.follow(Turn(prompt=["Task: fix it\nThought: read\nObs: ok"]))
    assert follow is not None and follow.program_id == claim.program_id


CORRECTION = {"role": "user", "content": "Format error: give exactly one bash block."}


def test_a_request_that_drops_the_answer_and_appends_a_correction_continues_the_program() -> None:
    index = ConversationIndex(10)
    program = started(index)  # its answer did not parse: the agent drops it
    assert answered(index, [SYSTEM, TASK, CORRECTION], ANSWER) == program
    assert program_of(index, [SYSTEM, TASK, CORRECTION, CORRECTION]) == program


def test_samples_that_all_drop_their_answers_stay_one_program_each() -> None:
    index = ConversationIndex(10)
    programs = {started(index) for _ in range(4)}
    retried = {answered(index, [SYSTEM, TASK, CORRECTION], ANSWER) for _ in range(4)}
    assert len(programs) == 4 and retried == programs


def test_the_same_first_request_again_is_a_new_program_not_a_retry() -> None:
    index = ConversationIndex(10)
    first = started(index)
    assert program_of(index, [SYSTEM, TASK]) != first
