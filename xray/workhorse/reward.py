"""RewardWorkhorse: a Hugging Face sequence-classification model that scores whole sequences.

The `reward` role when `reward.model` is set (and the sample job's `orm` with a model): each
Workhorse holds one data-parallel replica of an `AutoModelForSequenceClassification` with one
label, and scores each prompt + response by the logit at its last real token (right padding). The
sample job's `prm` role is one too: `score_steps` reads the head's logits at the last token of
each step instead (a causal trunk: the logit there sees exactly the prompt and the steps so far).
The model must share the policy's tokenizer: it reads the same token ids. Its config needs
`pad_token_id` (transformers finds each row's last real token by it). On a GPU the model lives
on the Workhorse's GPU: inputs move there, scores come back to host memory.
"""
from __future__ import annotations

import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.protocol import fanout
from xray.workhorse.base import Workhorse


STEP_ENDS = "step_ends"
"""[B, S] long: the position in INPUT_IDS of each step's last token, -1 past a row's last step."""


class RewardModelError(ValueError):
    """A reward model that cannot score sequences as asked."""


class RewardWorkhorse(Workhorse):
    """A replica of a sequence-classification reward model."""

    def init_dist(self, master_addr: str, master_port: int, timeout_s: float = 300.0) -> None:
        """Replicas share no collective: scoring needs none."""

    def setup(self) -> None:
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(self.config["model_dir"], dtype=torch.float32)
        self.model.to(self.torch_device)
        labels = self.model.config.num_labels
        if labels != 1 and not (labels == 2 and self.config.get("steps")):
            raise RewardModelError(f"the reward model in {self.config['model_dir']} has {labels} labels; a reward "
                                   "model needs num_labels=1 (a process reward model 1 or 2)")
        self.model.eval()

    @fanout(dispatch="slice", collect="flatten", reads=C.MODEL_INPUTS)
    def score(self, batch: Batch) -> torch.Tensor:
        """Scores [b]: the model's logit at each row's last real token."""
        device = self.model_device
        with torch.no_grad():
            out = self.model(input_ids=batch[C.INPUT_IDS].to(device), attention_mask=batch[C.ATTENTION_MASK].to(device))
        return out.logits[:, 0].float().cpu()

    @fanout(dispatch="slice", collect="flatten", reads=(*C.MODEL_INPUTS, STEP_ENDS))
    def score_steps(self, batch: Batch) -> torch.Tensor:
        """Step scores [b, S]: the probability that each step is right (sigmoid of a one-label head,
        softmax of a two-label head's second label) at the position in STEP_ENDS; NaN where a row
        has fewer steps (STEP_ENDS -1)."""
        head = getattr(self.model, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise RewardModelError(f"{type(self.model).__name__} has no `score` head to read every position of; "
                                   "a process reward model must be a decoder's *ForSequenceClassification")
        device = self.model_device
        ends = batch[STEP_ENDS].long().to(device)
        with torch.no_grad():
            hidden = self.model.base_model(input_ids=batch[C.INPUT_IDS].to(device),
                                           attention_mask=batch[C.ATTENTION_MASK].to(device)).last_hidden_state
            logits = head(hidden).float()  # [b, T, labels]
        at = logits.gather(1, ends.clamp(min=0)[:, :, None].expand(-1, -1, logits.shape[-1]))
        probs = torch.sigmoid(at[..., 0]) if at.shape[-1] == 1 else torch.softmax(at, -1)[..., 1]
        return torch.where(ends >= 0, probs, torch.full_like(probs, float("nan"))).cpu()
