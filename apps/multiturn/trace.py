"""Multi-turn chat traces: clients, rounds, a shared system prompt, user and answer lengths.

A trace fixes everything but the answers: client ``c``'s prompt in round ``r`` is its round
``r - 1`` prompt, the answer the model gave to it, and a new user turn. Answers are greedy,
so every mode (and every deployment shape) that serves the trace exactly sees the same
prompts. Lengths are drawn from :class:`Lengths` (a constant or a uniform range) with a
seeded generator, per client and round, so two runs of one trace agree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hicache_ray.base.errors import ConfigError

__all__ = ["Lengths", "Trace", "TraceConfig"]


@dataclass(frozen=True)
class Lengths:
    """Token counts: ``low`` when ``high`` is None, else uniform over [low, high]."""

    low: int
    high: int | None = None

    @classmethod
    def parse(cls, text: str, name: str) -> Lengths:
        """``"64"`` or ``"32-96"``."""
        try:
            low, _, high = text.partition("-")
            made = cls(int(low), int(high) if high else None)
        except ValueError:
            raise ConfigError(name, text, "not a length", 'use "N" or "LOW-HIGH"') from None
        if made.low < 0 or (made.high is not None and made.high < made.low):
            raise ConfigError(name, text, "not a valid range", "use 0 <= LOW <= HIGH")
        return made

    def draw(self, rnd: random.Random) -> int:
        return self.low if self.high is None else rnd.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.high is None else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class TraceConfig:
    """What the clients say; see the module docstring.

    Attributes:
        clients, rounds: conversations and turns per conversation.
        system_len: tokens of the system prompt every conversation starts with.
        user, answer: lengths of each user turn and of each answer (``max_new_tokens``).
        rate: requests per second within a round (exponential gaps); 0 sends a round's
            requests all at once.
        vocab: token ids are drawn below this.
        seed: seeds every draw.
    """

    clients: int = 8
    rounds: int = 4
    system_len: int = 128
    user: Lengths = field(default_factory=lambda: Lengths(64))
    answer: Lengths = field(default_factory=lambda: Lengths(32))
    rate: float = 0.0
    vocab: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("clients", "rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be positive", "use 1 or more")
        if self.system_len < 0 or self.rate < 0:
            raise ConfigError(
                "system_len/rate", (self.system_len, self.rate), "negative", "use 0 or more"
            )
        if self.user.low < 1 and self.system_len < 1:
            raise ConfigError("user", str(self.user), "prompts would be empty", "use >= 1 token")


class Trace:
    """The conversations of a :class:`TraceConfig`, advanced round by round."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        rnd = random.Random(config.seed)
        system = [rnd.randrange(config.vocab) for _ in range(config.system_len)]
        # turns[r][c] = (user tokens, answer length), drawn up front so runs agree
        self.turns = [
            [
                (
                    [rnd.randrange(config.vocab) for _ in range(config.user.draw(rnd))],
                    config.answer.draw(rnd),
                )
                for _ in range(config.clients)
            ]
            for _ in range(config.rounds)
        ]
        self.history = [list(system) for _ in range(config.clients)]

    def prompts(self, round_: int) -> list[tuple[list[int], int]]:
        """Each client's prompt and answer length in ``round_`` (call after the previous
        round's :meth:`record`)."""
        return [
            (self.history[c] + user, answer) for c, (user, answer) in enumerate(self.turns[round_])
        ]

    def record(self, round_: int, answers: list[list[int]]) -> None:
        """The answers of ``round_``: they join each client's history."""
        for c, (user, _) in enumerate(self.turns[round_]):
            self.history[c] += user + answers[c]
