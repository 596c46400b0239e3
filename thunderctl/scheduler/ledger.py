"""What a backend is charged: its programs' tokens, each shared prefix counted once."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from thunderctl.scheduler.program import Phase, Program


@dataclass
class Load:
    """Tokens charged on one backend, with each shared prefix counted once."""

    tokens: float = 0.0
    prefix_holders: Counter[str] = field(default_factory=Counter)

    def need(self, program: Program, weight: float, buffer: int) -> float:
        shared = program.prefix_key is not None and self.prefix_holders[program.prefix_key] > 0
        prefix = 0 if shared else program.prefix_tokens
        return weight * program.private_tokens + buffer + prefix

    def add(self, program: Program, weight: float, buffer: int) -> None:
        self.tokens += self.need(program, weight, buffer)
        if program.prefix_key is not None:
            self.prefix_holders[program.prefix_key] += 1

    def remove(self, program: Program, weight: float, buffer: int) -> None:
        if program.prefix_key is not None:
            self.prefix_holders[program.prefix_key] -= 1
        self.tokens -= self.need(program, weight, buffer)


@dataclass
class Ledger:
    """A backend's charges, kept up to date as programs come, go and change, so that a
    resume pass costs O(backends) rather than O(programs)."""

    private: int = 0  # Σ private tokens + buffer over its programs
    acting_private: int = 0  # Σ private tokens of its ACTING programs
    holders: Counter[str] = field(default_factory=Counter)
    prefix_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, program: Program, buffer: int) -> None:
        self.private += program.private_tokens + buffer
        if program.phase is Phase.ACTING:
            self.acting_private += program.private_tokens
        if program.prefix_key is not None:
            self.prefix_tokens.setdefault(program.prefix_key, program.prefix_tokens)
            self.holders[program.prefix_key] += 1

    def remove(self, program: Program, buffer: int) -> None:
        self.private -= program.private_tokens + buffer
        if program.phase is Phase.ACTING:
            self.acting_private -= program.private_tokens
        key = program.prefix_key
        if key is not None:
            self.holders[key] -= 1
            if self.holders[key] <= 0:
                del self.holders[key], self.prefix_tokens[key]

    def load(self, acting_weight: float) -> Load:
        tokens = self.private - (1.0 - acting_weight) * self.acting_private
        return Load(tokens + sum(self.prefix_tokens.values()), Counter(self.holders))
