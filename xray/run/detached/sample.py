"""One sample in the making inside an experience maker: its prompt's lease, the tokens so far with
their log-probs and the weight version that sampled each (`xray/run/detached/maker.py` for single
completions, `xray/run/detached/episode_maker.py` for episodes).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One sample in the making."""

    key: int
    """Its prompt's lease."""
    row: dict
    response: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    """Per response token, the weight version that sampled it."""
    done: bool = False
    epoch: int = 0
    """The trainer's rollbacks this maker had loaded when its tokens were checked last: after a
    rollback, its tokens sampled by discarded versions are cut (`_roll_back`)."""
