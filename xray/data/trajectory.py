"""A multi-turn trajectory, token-exact: the engine's tokens and the observations', never re-tokenized.

A trajectory starts from its prompt's token ids. Each model turn appends exactly the token ids the
engine produced, with the engine's log-prob of each (the behaviour log-probs); each observation
appends the environment's tokens (its text tokenized once, alone, or the ids it gave; in a chat
format, what the template writes after the model's turn: its end of turn, the observation's
messages, the generation prompt, rendered alone by `xray/data/chat_delta.py`). The history
is never decoded and tokenized again: applying a chat template to the whole conversation again can
give other ids than the engine saw (veRL found PPO then fails to converge), and costs time at
every turn. `mask` is 1 on the model's tokens and 0 on observations: the loss trains the model's
tokens only. `TrajectoryLimits` bound the turns, the tokens of one turn and of the whole
trajectory; `end` says why it ended.

`pack_trajectories` lays trajectories out as the training batch (`xray/data/sequences.py`: the
prompt, then every later token as the "response", LOSS_MASK from `mask`, BEHAVIOUR_LOGPROBS at the
model's tokens), with each trajectory's rewards summed into SCORES.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.sequences import pack_sequences

ENDS = ("done", "max_turns", "max_tokens", "error", "timeout")
"""Why a trajectory ended: the environment said done, a limit, or the environment failed."""


@dataclass(frozen=True)
class TrajectoryLimits:
    """Bounds of one trajectory."""

    max_turns: int = 8
    """Model turns at most."""
    max_turn_tokens: int = 256
    """Tokens one model turn may generate."""
    max_tokens: int = 2048
    """Tokens after the prompt (the model's and the observations') at most."""


@dataclass
class Trajectory:
    """One episode's tokens (see the module docstring)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    """After the prompt, in order: the model's turns and the observations."""
    mask: list[int] = field(default_factory=list)
    """Per token of `tokens`: 1 the model's, 0 an observation's."""
    logprobs: list[float] = field(default_factory=list)
    """Per token of `tokens`: the engine's log-prob of a model token, 0.0 on observations."""
    versions: list[int] = field(default_factory=list)
    """Per token of `tokens`: the weight version of the engine that produced the turn (an
    observation: the turn's before it); all 0 unless the engine reports one (an asynchronous
    run's maker: weights change between turns)."""
    turns: list[tuple[int, int]] = field(default_factory=list)
    """(start, end) of each model turn in `tokens`."""
    rewards: list[float] = field(default_factory=list)
    """The environment's reward after each model turn."""
    end: str = ""
    """Why it ended (`ENDS`); empty while it goes on."""
    detail: str = ""
    """The environment's error text, when it ended on one."""
    info: dict = field(default_factory=dict)
    """The environment's info after its last step (tool calls made, guesses...)."""

    def add_turn(self, ids: Sequence[int], logprobs: Sequence[float], version: int | Sequence[int] = 0) -> None:
        """A model turn: the engine's token ids and their log-probs, as produced (by weight `version`,
        or per token: a turn generated in segments may span a weight load)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"a model turn of {len(ids)} tokens came with {len(logprobs)} log-probs")
        versions = [int(version)] * len(ids) if isinstance(version, int) else [int(v) for v in version][:len(ids)]
        if len(versions) != len(ids):
            raise ValueError(f"a model turn of {len(ids)} tokens came with {len(versions)} versions")
        start = len(self.tokens)
        self.tokens += list(ids)
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += versions
        self.turns.append((start, len(self.tokens)))

    def add_observation(self, ids: Sequence[int]) -> None:
        """An observation's tokens (never trained on)."""
        self.tokens += list(ids)
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)

    def room(self, limits: TrajectoryLimits) -> int:
        """Tokens the next model turn may generate (0: the trajectory is full)."""
        if len(self.turns) >= limits.max_turns:
            return 0
        return max(0, min(limits.max_turn_tokens, limits.max_tokens - len(self.tokens)))

    def finish(self, end: str, detail: str = "") -> None:
        if end not in ENDS:
            raise ValueError(f"unknown end {end!r}; one of {', '.join(ENDS)}")
        self.end, self.detail = end, detail

    @property
    def ids(self) -> list[int]:
        """The whole sequence: prompt and every later token."""
        return self.prompt_ids + self.tokens

    @property
    def score(self) -> float:
        """The trajectory's return: its rewards summed."""
        return float(sum(self.rewards))


def pack_trajectories(trajectories: Sequence[Trajectory], pad_id: int = 0, versions: bool = False) -> Batch:
    """The training layout of `trajectories` (module docstring), with SCORES their returns; with
    `versions`, BEHAVIOUR_VERSIONS from each token's weight version."""
    batch = pack_sequences([t.prompt_ids for t in trajectories], [t.tokens for t in trajectories], pad_id,
                           response_logprobs=[t.logprobs for t in trajectories],
                           response_versions=[t.versions for t in trajectories] if versions else None,
                           response_masks=[t.mask for t in trajectories])
    batch[C.SCORES] = torch.tensor([t.score for t in trajectories], dtype=torch.float32)
    return batch
