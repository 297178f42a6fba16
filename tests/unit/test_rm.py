"""Reward-model training's pure parts: the Bradley-Terry loss, the pair layout, the export names."""
import math

import pytest
import torch

from algorithms.rm import LAST, PairwiseLoss, export_reward_model, last_values, pair_batch
from xray.data import columns as C

pytestmark = pytest.mark.unit


def test_pairwise_loss_hand_computed_with_gradient():
    values = torch.tensor([[0.0, 2.0, 9.0], [0.0, 1.0, 9.0], [0.5, 9.0, 9.0], [1.5, 9.0, 9.0]], requires_grad=True)
    last = torch.tensor([1, 1, 0, 0])  # chosen 2.0 vs rejected 1.0; chosen 0.5 vs rejected 1.5
    loss, metrics = PairwiseLoss()({C.VALUES: values}, {LAST: last})
    expected = (-math.log(1 / (1 + math.exp(-1.0))) - math.log(1 / (1 + math.exp(1.0)))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["rm_accuracy"] == 0.5 and metrics["rm_margin"] == pytest.approx(0.0)
    loss.backward()
    s1, s2 = 1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-1.0))  # sigmoid(-margin) per pair
    grad = torch.zeros(4, 3)
    grad[0, 1], grad[1, 1], grad[2, 0], grad[3, 0] = -s1 / 2, s1 / 2, -s2 / 2, s2 / 2
    torch.testing.assert_close(values.grad, grad)


def test_pair_batch_interleaves_and_leaves_room_for_the_last_value():
    batch = pair_batch([([1, 5], [7, 2], [8, 9, 2]), ([1], [6, 2], [2])], pad_id=0)
    assert batch[C.INPUT_IDS].tolist() == [[1, 5, 7, 2, 0, 0], [1, 5, 8, 9, 2, 0], [1, 6, 2, 0, 0, 0],
                                           [1, 2, 0, 0, 0, 0]]
    assert batch[LAST].tolist() == [3, 4, 2, 1]  # each row's last real token, below T-1
    values = torch.arange(24.0).reshape(4, 6)[:, :-1]  # the engines' [B, T-1]
    assert last_values(values, batch[LAST]).tolist() == [3.0, 10.0, 14.0, 19.0]


def test_export_names_the_head_score_and_drops_a_zero_bias(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": true}')
    w = torch.ones(1, 4)
    out = export_reward_model({"model.norm.weight": torch.ones(4), "value_head.weight": w,
                               "value_head.bias": torch.zeros(1)}, str(src), tmp_path / "rm", pad_id=0)
    import json

    from safetensors.torch import load_file
    assert sorted(load_file(str(out / "model.safetensors"))) == ["model.norm.weight", "score.weight"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    assert config["pad_token_id"] == 0 and "tie_word_embeddings" not in config
    with pytest.raises(ValueError, match="bias"):
        export_reward_model({"value_head.weight": w, "value_head.bias": torch.ones(1)}, str(src), tmp_path / "x", 0)
