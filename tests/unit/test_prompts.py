"""Prompt loading: JSONL / Parquet / datasets directories, extras, errors naming file and line,
truncation and rejection of long prompts, chat templates, splits and the resumable sampler."""
import json

import pytest

from xray.builtin.sources import load_prompt_splits
from xray.config.data import DataConfig
from xray.data.chat import ChatFormat
from xray.data.files import DataFileError, read_rows
from xray.data.prompts import PromptDataError, PromptSampler, load_prompts
from xray.data.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.unit

TOK = build_char_tokenizer()
ROWS = [{"prompt": "12+7=", "answer": "19", "level": 1},
        {"prompt": "3+4=", "answer": "7"},
        {"prompt": "ab", "answer": "x", "level": 3}]


def write_jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


def test_jsonl_prompts_ids_and_extras(tmp_path):
    ps = load_prompts(write_jsonl(tmp_path / "p.jsonl", ROWS), TOK)
    assert ps.prompts == ["12+7=", "3+4=", "ab"]
    # <s>=1, digits 0-9 -> 4..13, a-z -> 15..40, '+'=41, '='=45
    assert ps.prompt_ids == [[1, 5, 6, 41, 11, 45], [1, 7, 41, 8, 45], [1, 15, 16]]
    assert ps.extras == {"answer": ["19", "7", "x"], "level": [1, None, 3]}
    assert ps.where[1].endswith("p.jsonl:2")
    two = ps.select([2, 2, 0])
    assert two.prompts == ["ab", "ab", "12+7="] and two.extras["level"] == [3, 3, 1]


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], ["\n", '{"prompt": "1+1=", \n'])
    with pytest.raises(DataFileError, match=r"bad\.jsonl:4: not valid JSON"):
        load_prompts(path, TOK)
    with pytest.raises(DataFileError, match=r"arr\.jsonl:1: a JSON list, not an object"):
        read_rows(write_jsonl(tmp_path / "arr.jsonl", [], ["[1, 2]\n"]))


def test_empty_missing_and_unknown_files(tmp_path):
    with pytest.raises(DataFileError, match=r"empty\.jsonl is empty"):
        read_rows(write_jsonl(tmp_path / "empty.jsonl", [], ["\n", "  \n"]))
    with pytest.raises(DataFileError, match="does not exist"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "p.tsv").write_text("prompt\n1+1=\n")
    with pytest.raises(DataFileError, match="cannot read .*save_to_disk"):
        read_rows(tmp_path / "p.tsv")


def test_missing_prompt_field_names_the_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], {"question": "2+2="}])
    with pytest.raises(PromptDataError, match=r"p\.jsonl:2: no 'prompt' field .*data\.prompt_field"):
        load_prompts(path, TOK)
    with pytest.raises(PromptDataError, match=r"e\.jsonl:1: the prompt is a int"):
        load_prompts(write_jsonl(tmp_path / "e.jsonl", [{"prompt": 7}]), TOK)
    ps = load_prompts(write_jsonl(tmp_path / "q.jsonl", [{"question": "2+2=", "a": 4}]), TOK, prompt_field="question")
    assert ps.prompts == ["2+2="] and ps.extras == {"a": [4]}


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "3+4=", "answer": "7"}, {"prompt": "9+", "answer": "?"}]),
                   tmp_path / "p.parquet")
    ps = load_prompts(tmp_path / "p.parquet", TOK)
    assert ps.prompt_ids == [[1, 7, 41, 8, 45], [1, 13, 41]] and ps.extras == {"answer": ["7", "?"]}
    pq.write_table(pa.Table.from_pylist([{"text": "x"}, {"text": "y"}]), tmp_path / "q.parquet")
    with pytest.raises(PromptDataError, match=r"q\.parquet row 0: no 'prompt' field"):
        load_prompts(tmp_path / "q.parquet", TOK)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataFileError, match="not a readable Parquet file"):
        read_rows(tmp_path / "broken.parquet")


def test_datasets_directory(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS[:2]).save_to_disk(str(tmp_path / "flat"))
    ps = load_prompts(tmp_path / "flat", TOK)
    assert ps.prompts == ["12+7=", "3+4="] and ps.extras["answer"] == ["19", "7"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[1:]),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(tmp_path / "dict"))
    assert load_prompts(tmp_path / "dict", TOK).prompts == ["3+4=", "ab"]
    datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS), "b": datasets.Dataset.from_list(ROWS)}
                         ).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(DataFileError, match=r"holds the splits \['a', 'b'\] and the config asks for 'train'"):
        read_rows(tmp_path / "nosplit")


def test_long_prompts_truncate_left_keeping_bos_or_reject(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}, {"prompt": "123456+7="}])
    ps = load_prompts(path, TOK, max_prompt_tokens=5, on_long_prompt="truncate")
    assert ps.prompt_ids[0] == [1, 5, 41, 5, 45]            # exactly 5: untouched
    assert ps.prompt_ids[1] == [1, 10, 41, 11, 45]          # <s> + last 4 of "123456+7=" ("6+7=")
    assert ps.truncated == 1
    with pytest.raises(PromptDataError, match=r"p\.jsonl:2: the prompt has 10 tokens.*on_long_prompt"):
        load_prompts(path, TOK, max_prompt_tokens=5, on_long_prompt="reject")


def test_chat_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                         "{% if add_generation_prompt %}a:{% endif %}")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": [{"role": "user", "content": "yo"}]}])
    ps = load_prompts(path, tok)  # auto: the tokenizer has a template
    assert [tok.decode(i) for i in ps.prompt_ids] == ["u:hi;a:", "u:yo;a:"]
    assert ps.prompts[1] == [{"role": "user", "content": "yo"}]
    plain = load_prompts(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "hi"}]), tok, chat=ChatFormat("none"))
    assert plain.prompt_ids == [[1, 22, 23]]
    with pytest.raises(PromptDataError, match=r"p\.jsonl:2: .*no chat template"):
        load_prompts(path, TOK)


def test_splits_user_file_and_builtin(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    train, held = load_prompt_splits(DataConfig(path=str(path), eval_size=3), TOK, tmp_path)
    # a seeded sample (data.eval_seed=0: rows 0, 6 and 9), not the file's last rows; both in file order
    assert held.prompts == ["0+1=", "6+1=", "9+1="] and held.where[1].endswith("p.jsonl:7")
    assert train.extras["answer"] == ["2", "3", "4", "5", "6", "8", "9"]
    with pytest.raises(PromptDataError, match="data.eval_size below 10"):
        load_prompt_splits(DataConfig(path=str(path), eval_size=10), TOK, tmp_path)
    train, held = load_prompt_splits(DataConfig(), TOK, tmp_path / "run")
    assert (len(train), len(held)) == (800, 200) and not set(train.prompts) & set(held.prompts)
    assert (tmp_path / "run" / "arith-eval.jsonl").exists()
    assert all(str(eval(p[:-1])) == a for p, a in zip(held.prompts, held.extras["answer"]))


def test_sampler_epochs_and_exact_resume():
    s = PromptSampler(size=10, batch_size=4, seed=7)
    first = [s.next_indices() for _ in range(2)]
    assert sorted(first[0] + first[1]) == sorted(set(first[0] + first[1]))   # no repeats inside an epoch
    saved = s.state_dict()
    third = s.next_indices()                                                   # 2 left over: new epoch
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 4
    resumed = PromptSampler(10, 4, 7)
    resumed.load_state_dict(saved)
    assert resumed.next_indices() == third
    assert PromptSampler(10, 4, 7).next_indices() == first[0] and PromptSampler(10, 4, 8).next_indices() != first[0]
    with pytest.raises(PromptDataError, match="same data"):
        PromptSampler(10, 2, 7).load_state_dict(saved)
    with pytest.raises(PromptDataError, match="rollout_batch_size between 1 and 10"):
        PromptSampler(10, 11, 0)
