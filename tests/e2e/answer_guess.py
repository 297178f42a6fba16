"""The e2e tests' environment, in a file of its own: an asynchronous run's makers (Ray actors of
the run's own processes) load it by path, with nothing of the tests imported."""
from pathlib import Path

ANSWER_GUESS = {"name": f"{Path(__file__).resolve()}:AnswerGuess", "max_turns": 3, "max_turn_tokens": 4,
                "max_tokens": 24}
"""The `env` section playing it: up to 3 turns of 4 tokens."""


class AnswerGuess:
    """The guessing game on an arithmetic prompt: the secret is its answer; each turn earns its
    digit share (graded: the untrained tiny model earns some), and the answer itself 1 (the episode ends)."""

    async def reset(self, row: dict) -> str:
        self.answer = int(row["answer"])
        return row["prompt"]

    async def step(self, action: str):
        digits = "".join(c for c in action if c.isdigit())
        reward = len(digits) / max(1, len(action))
        if not digits:
            return " no number", reward, False, {}
        if int(digits) == self.answer:
            return "", 1.0 + reward, True, {}
        return " higher" if int(digits) < self.answer else " lower", reward, False, {}
