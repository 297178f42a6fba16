"""RewardWorkhorse: a Hugging Face sequence-classification model that scores whole sequences.

The `reward` role when `reward.model` is set: each Workhorse holds one data-parallel replica of
an `AutoModelForSequenceClassification` with one label, and scores each prompt + response by the
logit at its last real token (right padding). The reward model must share the policy's
tokenizer: it reads the same token ids. Its config needs `pad_token_id` (transformers finds
each row's last real token by it).
"""
from __future__ import annotations

import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.wholemodel.protocol import fanout
from xray.workhorse.base import Workhorse


class RewardModelError(ValueError):
    """A reward model that cannot score sequences as asked."""


class RewardWorkhorse(Workhorse):
    """A replica of a sequence-classification reward model."""

    def init_dist(self, master_addr: str, master_port: int, timeout_s: float = 300.0) -> None:
        """Replicas share no collective: scoring needs none."""

    def setup(self) -> None:
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(self.config["model_dir"], dtype=torch.float32)
        if self.model.config.num_labels != 1:
            raise RewardModelError(f"the reward model in {self.config['model_dir']} has "
                                   f"{self.model.config.num_labels} labels; a reward model needs num_labels=1")
        self.model.eval()

    @fanout(dispatch="slice", collect="flatten", reads=C.MODEL_INPUTS)
    def score(self, batch: Batch) -> torch.Tensor:
        """Scores [b]: the model's logit at each row's last real token."""
        with torch.no_grad():
            out = self.model(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK])
        return out.logits[:, 0].float()
