"""Each generation API's usage in chat's terms (`prompt_tokens`, `completion_tokens`,
`prompt_tokens_details.cached_tokens`): the gateway schedules by it and bench reports it, whichever
API carried the request."""

from __future__ import annotations

from typing import Any

Usage = dict[str, Any]  # chat's: prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens


def responses_usage(usage: dict[str, Any]) -> Usage:
    """A Responses usage (`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`)."""
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "prompt_tokens": usage.get("input_tokens") or 0,
        "completion_tokens": usage.get("output_tokens") or 0,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def messages_usage(usage: dict[str, Any]) -> Usage:
    """A Messages usage: Anthropic counts the prompt in three parts, the uncached, the read from cache
    and the written. Only what it says: a stream's `message_start` and `message_delta` each carry part."""
    cached = usage.get("cache_read_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + cached + (usage.get("cache_creation_input_tokens") or 0)
    found: Usage = {}
    if "input_tokens" in usage:
        found |= {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
    if "output_tokens" in usage:
        found["completion_tokens"] = usage.get("output_tokens") or 0
    return found
