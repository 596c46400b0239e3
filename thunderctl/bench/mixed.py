"""`--workload mixed`: the recorded SWE-bench Lite runs with OpenHands-like long programs among them.

Real traffic is not one harness on one benchmark: next to mini-swe-agent's short runs (~36 steps,
~20k tokens at the end) come agents that read whole files and test logs for 30–90 steps and end
near 100k tokens. The sizes then differ by an order of magnitude, and two workers that each hold
a random half of the programs hold very different amounts of KV — the cross-node imbalance the
paper measures (its Fig. 2a). Neither workload alone shows it: within one, the sizes are alike
enough to average out over the 30–70 programs a worker holds.

Program `index` of seed `seed` is, by a generator seeded by both, a long-tail program
(thunderctl/bench/long_tail.py) with probability `long_share`, otherwise one of the recorded runs
picked at random; the same (seed, index) is the same program in every arm and run. The shared
prefix is the recorded runs' system prompt (160 tokens), the only one every program carries:
the long programs' own 5,000-token prompt is shared among them in reality, so the cache hits
here are a little low for them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from thunderctl.bench.long_tail import TOOL_SECONDS as LONG_TAIL_TOOL_SECONDS
from thunderctl.bench.long_tail import draw_program as draw_long_tail
from thunderctl.bench.recorded import RECORDED_SWE_LITE_SOURCE
from thunderctl.bench.swe_lite import ScaledWorkload
from thunderctl.traceformat import TraceProgram

# A quarter long programs: they then hold about half the KV of the mix (each ~3× a recorded one).
LONG_SHARE = 0.25


@dataclass(frozen=True)
class Mixed(ScaledWorkload):
    """The workload: programs by (seed, index); satisfies closed_loop's Workload."""

    long_share: float = LONG_SHARE
    recorded: tuple[TraceProgram, ...] = field(default=(), kw_only=True)
    name: ClassVar[str] = "mixed"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.recorded:
            raise ValueError("the mixed workload needs the recorded programs")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share is a share of the programs, between 0 and 1; got {self.long_share}")

    def program(self, seed: int, index: int) -> TraceProgram:
        rng = random.Random(f"mixed/{seed}/{index}")
        if rng.random() < self.long_share:
            program = draw_long_tail(rng, f"mixed-{seed}-{index}", LONG_TAIL_TOOL_SECONDS)
        else:
            program = rng.choice(self.recorded)
        return program.scaled(self.scale)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "long_share": self.long_share,
            "recorded": f"{len(self.recorded)} programs: {RECORDED_SWE_LITE_SOURCE}",
            "scale": self.scale,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "max_context_tokens": self.max_context_tokens,
        }
