"""The SDK agent loops of test_harnesses.py (the OpenAI Agents SDK on Responses, the Anthropic SDK on
Messages, the OpenAI SDK on chat; tests/support.py) against `thunderctl serve` over a simulated worker:
the same answers as straight to the worker, and one program of all the loop's turns.

The simulated model calls the tool every answer offers, so these loops answer its calls; against the
tiny model (test_harnesses.py) they call the tool themselves.
"""

from __future__ import annotations

import pytest

from support import SDK_LOOPS, through_the_gateway_as_straight

MODEL = "tiny"
# Room for six turns of history, with answers of the length the simulated model picks when a request
# names none (the Agents SDK's do not).
SIM = ("--preset", "cpu-tiny", "--kv-blocks", "1024", "--block-size", "16", "--max-model-len", "8192",
       "--time-scale", "0.01")  # fmt: skip


# Importing the Agents SDK or the Anthropic SDK costs seconds (5-7 s of these tests on a busy machine).
IMPORTS_FOR_SECONDS = {"agents-sdk", "anthropic-sdk"}


@pytest.mark.parametrize(
    "client", [pytest.param(c, marks=[pytest.mark.slow] if c in IMPORTS_FOR_SECONDS else []) for c in SDK_LOOPS]
)
@pytest.mark.slow
def test_a_scripted_sdk_agent_over_the_simulated_engine_is_one_program_of_all_its_turns(
    client: str, start_sim, start_gateway
) -> None:
    through_the_gateway_as_straight(SDK_LOOPS[client], start_sim(*SIM).url, MODEL, start_gateway)
