"""FunctionRewardWorkhorse: a reward function run in a process on its own device.

The sample job's `orm` role when `reward.function` (or `reward.functions`) names Python functions
(ms-swift places its outcome reward, a model or a function, on the `rm_group`'s devices): each
Workhorse loads the functions and the model directory's tokenizer once, and scores its slice of
the candidates the way the RL algorithms call the same functions on the driver
(`xray.rewards.loader.RewardScorer`: TRL's convention, every dataset column as a keyword argument).
A slow or heavy function (a code sandbox, a verifier) then runs beside the sampler instead of in
the driver, one replica per device.
"""
from __future__ import annotations

import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.protocol import fanout
from xray.workhorse.base import Workhorse

ROWS = "rows"
"""A list column: each candidate's prompt row (`prompt` and the dataset's other columns)."""


class FunctionRewardWorkhorse(Workhorse):
    """One replica of a reward function."""

    def init_dist(self, master_addr: str, master_port: int, timeout_s: float = 300.0) -> None:
        """Replicas share no collective: scoring needs none."""

    def setup(self) -> None:
        from transformers import AutoTokenizer

        from xray.rewards.loader import RewardScorer

        tokenizer = AutoTokenizer.from_pretrained(self.config["model_dir"])
        c = self.config
        self.scorer = RewardScorer(c["functions"], tokenizer, c.get("on_nonfinite", "error"), c.get("weights"),
                                   c.get("workers", 0))

    @fanout(dispatch="slice", collect="flatten", reads=(ROWS, C.RESPONSE_IDS))
    def score(self, batch: Batch) -> torch.Tensor:
        """Scores [b] of the candidates (RESPONSE_IDS, with their prompt ROWS); NaN where the
        function gave no usable score and `on_nonfinite` is `skip`."""
        scores, keep = self.scorer(batch[ROWS], batch[C.RESPONSE_IDS])
        return torch.where(keep, scores, torch.full_like(scores, float("nan")))
