"""On a GPU the Hugging Face and reward Workhorses move their inputs to their model's device and
their answers back to host memory. Without a GPU, a model on torch's `meta` device stands in for
one: the inputs must arrive there (they come in on the CPU), the answers must leave as CPU tensors."""
import types

import pytest
import torch

from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.data.batch import Batch

pytestmark = pytest.mark.unit


def inputs(rows=4, width=6, **extra):
    ids = torch.arange(rows * width).reshape(rows, width) % 7 + 1
    return Batch({C.INPUT_IDS: ids, C.ATTENTION_MASK: torch.ones_like(ids), **extra})


def hf_workhorse():
    from xray.backends.optim import build_optimizer, build_scheduler
    from xray.config.optim import OptimConfig
    from xray.workhorse.hf import HFWorkhorse

    wh = HFWorkhorse("actor", 0, ParallelDims(), threads=torch.get_num_threads(), model_dir="unused")
    wh.model = torch.nn.Linear(2, 2, device="meta")  # a model "on another device"
    wh.optim_cfg = OptimConfig(grad_clip=1.0)
    wh.optimizer = build_optimizer(wh.model.parameters(), wh.optim_cfg)
    wh.scheduler = build_scheduler(wh.optimizer, wh.optim_cfg)
    return wh


def test_workhorse_device_names():
    from xray.workhorse.base import Workhorse

    assert Workhorse("actor", 0, ParallelDims(), device="GPU", threads=torch.get_num_threads()).torch_device == "cuda"
    assert Workhorse("actor", 0, ParallelDims(), device="cpu", threads=torch.get_num_threads()).torch_device == "cpu"


def test_hf_forward_moves_the_batch_to_the_model_and_the_answer_back(monkeypatch):
    from xray.workhorse import hf

    seen = []

    def logprobs(model, batch):
        seen.append((batch[C.INPUT_IDS].device.type, batch[C.ATTENTION_MASK].device.type))
        return torch.full((len(batch), batch[C.INPUT_IDS].shape[1] - 1), -1.5)
    monkeypatch.setattr(hf, "hf_logprobs", logprobs)
    out = hf_workhorse().forward(inputs())
    assert seen == [("meta", "meta")]
    assert out[C.LOGPROBS].device.type == "cpu" and out[C.LOGPROBS].shape == (4, 5)
    assert out[C.LOGPROBS].sum().item() == -1.5 * 20


def test_hf_train_step_moves_every_micro_batch_to_the_model(monkeypatch):
    from xray.workhorse import hf

    weight = torch.ones(1, requires_grad=True)
    seen = []

    def logprobs(model, batch):
        seen.append(batch[C.INPUT_IDS].device.type)
        return (weight * 2.0).expand(len(batch), batch[C.INPUT_IDS].shape[1] - 1)

    def loss_fn(outputs, batch):
        seen.append(batch[C.ADVANTAGES].device.type)
        return outputs[C.LOGPROBS].mean()
    monkeypatch.setattr(hf, "hf_logprobs", logprobs)
    metrics = hf_workhorse().train_step(inputs(advantages=torch.ones(4, 5)), loss_fn, micro_batch_size=2)
    assert seen == ["meta", "meta"] * 2  # two micro-batches, model inputs and loss columns both moved
    assert metrics["loss"] == pytest.approx(2.0)


class MetaClassifier(torch.nn.Module):
    """A one-label classifier 'on another device' that records where its inputs are."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(2, 1, device="meta")
        self.seen = []

    def forward(self, input_ids, attention_mask):
        self.seen.append((input_ids.device.type, attention_mask.device.type))
        return types.SimpleNamespace(logits=torch.tensor([[2.0], [3.0], [5.0], [7.0]]))


def test_reward_score_moves_inputs_to_the_model_and_scores_back():
    from xray.workhorse.reward import RewardWorkhorse

    wh = RewardWorkhorse("reward", 0, ParallelDims(), threads=torch.get_num_threads(), model_dir="unused")
    wh.model = MetaClassifier()
    scores = wh.score(inputs())
    assert wh.model.seen == [("meta", "meta")]
    assert scores.device.type == "cpu" and scores.tolist() == [2.0, 3.0, 5.0, 7.0]
