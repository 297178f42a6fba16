"""The eval set (`xray.builtin.sources`): a separate `data.eval_path`, a `data.eval_split` of the same
data, or, when neither is set, a seeded random hold-out of `data.path` disjoint from training."""
import json

import pytest

from xray.builtin.sources import load_prompt_splits, load_row_splits
from xray.config.data import DataConfig
from xray.data.files import DataFileError
from xray.data.prompts import PromptDataError
from xray.data.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.unit

TOK = build_char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sums(start, stop):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(start, stop)]


def test_eval_path_is_evaluated_and_path_trained_whole(tmp_path):
    train_file, eval_file = write_jsonl(tmp_path / "train.jsonl", sums(0, 10)), write_jsonl(tmp_path / "ev.jsonl", sums(50, 54))
    train, held = load_prompt_splits(DataConfig(path=str(train_file), eval_path=str(eval_file), eval_size=4), TOK, tmp_path)
    assert train.prompts == [f"{i}+1=" for i in range(10)]
    assert held.prompts == ["50+1=", "51+1=", "52+1=", "53+1="] and held.extras["answer"] == ["51", "52", "53", "54"]
    # eval_size below its row count: a seeded sample of it, in file order
    _, two = load_prompt_splits(DataConfig(path=str(train_file), eval_path=str(eval_file), eval_size=2), TOK, tmp_path)
    assert two.prompts == ["51+1=", "53+1="]                                  # rows 1 and 3 (eval_seed 0)
    with pytest.raises(PromptDataError, match=r"eval rows \(data.eval_path\) are 4, fewer than data.eval_size=5; "
                                              "set data.eval_size to 4 or fewer"):
        load_prompt_splits(DataConfig(path=str(train_file), eval_path=str(eval_file), eval_size=5), TOK, tmp_path)
    with pytest.raises(DataFileError, match=r"^data.eval_path: .*missing\.jsonl does not exist"):
        load_prompt_splits(DataConfig(path=str(train_file), eval_path=str(tmp_path / "missing.jsonl")), TOK, tmp_path)


def test_eval_split_of_a_hub_layout_directory(tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    write_jsonl(hub / "train.jsonl", sums(0, 6))
    write_jsonl(hub / "test.jsonl", sums(20, 23))
    train, held = load_prompt_splits(DataConfig(path=str(hub), eval_split="test", eval_size=3), TOK, tmp_path)
    assert train.prompts == [f"{i}+1=" for i in range(6)] and held.prompts == ["20+1=", "21+1=", "22+1="]
    # the split trained on is data.split: train on `test`, hold rows out of it
    train, held = load_prompt_splits(DataConfig(path=str(hub), split="test", eval_size=1), TOK, tmp_path)
    assert len(train) == 2 and len(held) == 1 and sorted(train.prompts + held.prompts) == ["20+1=", "21+1=", "22+1="]
    with pytest.raises(PromptDataError, match="data.eval_split='train' is the split trained on"):
        load_prompt_splits(DataConfig(path=str(hub), eval_split="train"), TOK, tmp_path)
    with pytest.raises(DataFileError, match=r"^data.path / data.eval_split: .*holds the splits \['test', 'train'\] "
                                            "and the config asks for 'validation'"):
        load_prompt_splits(DataConfig(path=str(hub), eval_split="validation"), TOK, tmp_path)


def test_default_hold_out_is_seeded_and_disjoint(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl", sums(0, 40)))

    def split(seed):
        return load_prompt_splits(DataConfig(path=path, eval_size=8, eval_seed=seed), TOK, tmp_path)

    train, held = split(0)
    again_train, again_held = split(0)
    _, other = split(1)
    assert held.prompts == again_held.prompts and train.prompts == again_train.prompts
    assert held.prompts != other.prompts
    assert len(train) == 32 and len(held) == 8 and not set(train.prompts) & set(held.prompts)
    assert sorted(train.prompts + held.prompts) == sorted(f"{i}+1=" for i in range(40))
    assert held.prompts != [f"{i}+1=" for i in range(32, 40)]                 # not the file's last rows
    order = [int(p.split("+")[0]) for p in held.prompts]
    assert order == sorted(order)                                              # file order kept
    rows_train, rows_held = load_row_splits(DataConfig(path=path, eval_size=8), tmp_path)
    assert [r["prompt"] for r in rows_held.rows] == held.prompts and len(rows_train) == 32


def test_builtin_tasks_keep_their_own_eval_split(tmp_path):
    with pytest.raises(PromptDataError, match="builtin:arith writes its own train and eval splits.*leave data.eval_path"):
        load_prompt_splits(DataConfig(eval_path=str(tmp_path / "x.jsonl")), TOK, tmp_path)
    train, held = load_row_splits(DataConfig(path="builtin:arith_small", eval_size=50), tmp_path)
    assert (len(train), len(held)) == (150, 50) and held.where[0].endswith("arith_small-eval.jsonl:1")
