"""Small synthetic agent logs in mini-swe-agent's formats, written by the importer tests."""

from __future__ import annotations

import json
from pathlib import Path

# (prompt tokens, completion tokens, created) per LLM call
Call = tuple[int, int, int]


def write_trajectory(directory: Path, instance_id: str, calls: list[Call]) -> Path:
    """A mini-swe-agent v1 `.traj.json`: system and task, then per call an assistant message
    carrying the provider's response (usage, created) and the observation that followed."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a helpful assistant that can interact with a computer."},
        {"role": "user", "content": f"Please solve this issue: {instance_id}"},
    ]
    for number, (prompt, completion, created) in enumerate(calls):
        response = {
            "id": f"gen-{number}",
            "created": created,
            "model": "test/model",
            "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ls"}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }
        messages.append(
            {"role": "assistant", "content": "THOUGHT: look.\n```bash\nls\n```", "extra": {"response": response}}
        )
        messages.append({"role": "user", "content": "<returncode>0</returncode>\n<output>setup.py</output>"})
    trajectory = {
        "info": {"exit_status": "Submitted", "mini_version": "1.15.0", "model_stats": {"api_calls": len(calls)}},
        "messages": messages,
        "trajectory_format": "mini-swe-agent-1",
        "instance_id": instance_id,
    }
    path = directory / f"{instance_id}.traj.json"
    path.write_text(json.dumps(trajectory))
    return path


def step_table_line(instance_id: str, calls: list[Call], *, lite: bool) -> str:
    """One run of a step table, with the fields the importer does not use beside the ones it does."""
    steps = [
        {"prompt_tokens": p, "completion_tokens": c, "cached_tokens": 0, "created": t, "obs_chars": 40}
        for p, c, t in calls
    ]
    return json.dumps({"instance_id": instance_id, "lite": lite, "exit_status": "Submitted", "steps": steps})
