"""Built-in tasks `builtin:arith` and `builtin:reverse`, the character tokenizer (loadable from a model directory) and the
supervised warm-start batch and loss, with hand-computed values."""
import json
import math
import pickle

import pytest
import torch

from xray.data import columns as C
from xray.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, VOCAB_SIZE, build_char_tokenizer, save_char_tokenizer
from xray.builtin.tasks import TaskError, get_task
from xray.builtin.arith import ARITH, ArithTask
from xray.data.sequences import pack_sequences
from xray.data.supervised import SFTLoss, sft_batch

pytestmark = pytest.mark.unit


def test_arith_is_deterministic_disjoint_and_correct(tmp_path):
    train, held = ARITH.splits(200)
    assert (len(train), len(held)) == (800, 200)
    assert held[:2] == [{"prompt": "43+9=", "answer": "52"}, {"prompt": "62+1=", "answer": "63"}]
    assert train[0] == {"prompt": "60+9=", "answer": "69"}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for r in train + held:
        a, b = r["prompt"][:-1].split("+")
        assert int(a) + int(b) == int(r["answer"]) and 0 <= int(b) <= 9
    assert ArithTask(seed=1).splits(200)[1] != held
    files = get_task("builtin:arith").write(tmp_path, eval_size=250)
    lines = files.eval.read_text().splitlines()
    assert len(lines) == 250 and json.loads(lines[0]) == held[0]
    assert len(files.train.read_text().splitlines()) == 750


def test_reverse_is_disjoint_and_correct(tmp_path):
    files = get_task("builtin:reverse").write(tmp_path, eval_size=200)
    train = [json.loads(line) for line in files.train.read_text().splitlines()]
    held = [json.loads(line) for line in files.eval.read_text().splitlines()]
    assert (len(train), len(held)) == (700, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(r["prompt"][:3][::-1] == r["answer"] and r["prompt"][3] == ">" for r in train + held)
    assert {"prompt": "390>", "answer": "093"} in train + held  # leading zeros kept
    from xray.rewards.builtin import exact_answer

    assert exact_answer(["390>", "390>"], ["093", "93"], ["093", "093"]) == [1.0, 0.0]
    with pytest.raises(TaskError, match="between 1 and 899"):
        get_task("builtin:reverse").write(tmp_path, eval_size=900)


def test_unknown_task_and_bad_eval_size():
    with pytest.raises(TaskError, match="builtin:arith"):
        get_task("builtin:chess")
    with pytest.raises(TaskError, match="between 1 and 999"):
        ARITH.splits(1000)


def test_char_tokenizer_ids_and_roundtrip():
    tok = build_char_tokenizer()
    assert VOCAB_SIZE == len(tok) == 64
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)   # what xray.builtin.tiny_llama configures
    assert tok("37+5=").input_ids == [1, 7, 11, 41, 9, 45]
    assert tok("42", add_special_tokens=False).input_ids == [8, 6]
    assert tok.decode([8, 6, EOS_ID, PAD_ID], skip_special_tokens=True) == "42"
    assert tok("a b\nZ").input_ids == [1, 15, 14, 16, UNK_ID, UNK_ID]
    text = "what is 12*(3-1)? 24."
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text


def test_tokenizer_loads_from_a_model_directory(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from xray.builtin.tiny_llama import TinySpec, build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", TinySpec(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64,
                                                          num_layers=1, num_heads=2, num_kv_heads=2))
    save_char_tokenizer(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    assert tok("9+9=").input_ids == [1, 13, 41, 13, 45]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (config.eos_token_id, config.pad_token_id,
                                                                      config.bos_token_id)
    assert config.vocab_size == len(tok)


def test_pack_sequences_layout():
    b = pack_sequences([[1, 5, 45], [1, 45]], [[10, 2], [4, 4, 2]])
    assert b[C.INPUT_IDS].tolist() == [[1, 5, 45, 10, 2], [1, 45, 4, 4, 2]]
    assert b[C.ATTENTION_MASK].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # LOSS_MASK[t] = 1 when token t+1 is a response token
    assert b[C.LOSS_MASK].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    short = pack_sequences([[1, 5]], [[2]])
    assert short[C.LOSS_MASK].tolist() == [[0, 1]] and short[C.RESPONSE_IDS] == [[2]]
    padded = pack_sequences([[1, 5, 6], [1]], [[2], [7, 2]])
    assert padded[C.INPUT_IDS].tolist() == [[1, 5, 6, 2], [1, 7, 2, 0]]
    assert padded[C.ATTENTION_MASK].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert padded[C.LOSS_MASK].tolist() == [[0, 0, 1], [1, 1, 0]]


def test_sft_batch_targets_answer_and_eos():
    tok = build_char_tokenizer()
    b = sft_batch([tok("5+1=").input_ids], ["6"], tok)
    assert b[C.INPUT_IDS].tolist() == [[1, 9, 41, 5, 45, 10, EOS_ID]]
    assert b[C.LOSS_MASK].tolist() == [[0, 0, 0, 0, 1, 1]]


def test_sft_loss_hand_computed_and_picklable():
    loss_fn = pickle.loads(pickle.dumps(SFTLoss()))
    logp = torch.log(torch.tensor([[0.9, 0.5, 0.25, 0.8]]))
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    from xray.data.batch import Batch
    loss, metrics = loss_fn({C.LOGPROBS: logp}, Batch({C.LOSS_MASK: mask}))
    assert loss.item() == pytest.approx((math.log(2) + math.log(4)) / 2, abs=1e-6)
    assert metrics["sft_loss"] == pytest.approx(1.5 * math.log(2), abs=1e-6)
    assert metrics["token_p_gt_half"] == 0.0   # 0.5 is not above one half
