"""Data files as users keep them (`xray.data.files`): every form reads to the same rows, exactly as
written (lists and structs kept), splits are chosen by name, and each mistake's error says the fix."""
import bz2
import gzip
import json
import lzma

import pytest

from xray.data.files import DataFileError, Rows, read_rows

pytestmark = pytest.mark.unit

# veRL's shape: `prompt` a list of messages, `reward_model` a struct; one plain-string row
ROWS = [{"prompt": [{"role": "user", "content": "2+3="}], "answer": "5", "reward_model": {"ground_truth": "5"}},
        {"prompt": [{"role": "user", "content": "7*6="}], "answer": "42", "reward_model": {"ground_truth": "42"}},
        {"prompt": [{"role": "user", "content": "1-1="}], "answer": "0", "reward_model": {"ground_truth": "0"}}]
FLAT = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "7*6=", "answer": "42"}]


def lines(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_every_file_form_reads_the_same_rows(tmp_path):
    import pyarrow as pa

    (tmp_path / "a.json").write_text(json.dumps(ROWS))                  # MATH-style JSON array
    (tmp_path / "lines.json").write_bytes(lines(ROWS))                  # JSON lines under a .json name
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines(ROWS)))
    (tmp_path / "a.jsonl.bz2").write_bytes(bz2.compress(lines(ROWS)))
    (tmp_path / "a.ndjson.xz").write_bytes(lzma.compress(lines(ROWS)))
    with pa.output_stream(str(tmp_path / "a.jsonl.zst"), compression="zstd") as s:
        s.write(lines(ROWS))
    parquet(tmp_path / "a.parquet", ROWS)
    for name in ("a.json", "lines.json", "a.jsonl.gz", "a.jsonl.bz2", "a.ndjson.xz", "a.jsonl.zst", "a.parquet"):
        rows, where = read_rows(tmp_path / name)
        assert rows == ROWS, name
        assert len(where) == 3 and where[2].startswith(str(tmp_path / name))
    assert read_rows(tmp_path / "a.jsonl.gz")[1][1].endswith("a.jsonl.gz:2")     # JSON lines: the line
    assert read_rows(tmp_path / "a.parquet")[1][1].endswith("a.parquet row 1")
    (tmp_path / "one.json").write_text(json.dumps(ROWS[0]))             # one object: one row (MATH's per-problem files)
    assert read_rows(tmp_path / "one.json")[0] == ROWS[:1]


def test_csv_plain_and_compressed(tmp_path):
    text = 'prompt,answer\n2+3=,5\n"a, b",x\n'
    (tmp_path / "p.csv").write_text(text)
    (tmp_path / "p.csv.gz").write_bytes(gzip.compress(text.encode()))
    for name in ("p.csv", "p.csv.gz"):
        rows, where = read_rows(tmp_path / name)
        assert rows == [{"prompt": "2+3=", "answer": "5"}, {"prompt": "a, b", "answer": "x"}]
        assert where == [f"{tmp_path / name} row 0", f"{tmp_path / name} row 1"]


def test_json_is_read_exactly_as_written(tmp_path):
    """Arrow would make "1" and 2 both integers and give the second row a None `level`."""
    rows = [{"prompt": "a", "answer": "1", "level": 1}, {"prompt": "b", "answer": 2}]
    (tmp_path / "p.jsonl").write_bytes(lines(rows))
    assert read_rows(tmp_path / "p.jsonl")[0] == rows


def test_lists_and_globs_read_in_order(tmp_path):
    (tmp_path / "part-1.jsonl").write_bytes(lines(FLAT[:1]))
    (tmp_path / "part-2.jsonl").write_bytes(lines(FLAT[1:]))
    rows, where = read_rows(str(tmp_path / "part-*.jsonl"))
    assert rows == FLAT and [w.rsplit("/", 1)[1] for w in where] == ["part-1.jsonl:1", "part-2.jsonl:1"]
    rows, _ = read_rows([str(tmp_path / "part-2.jsonl"), str(tmp_path / "part-1.jsonl")])
    assert rows == FLAT[::-1]
    with pytest.raises(DataFileError, match="matches no file; give a JSON, JSONL, Parquet or CSV"):
        read_rows(str(tmp_path / "nothing-*.jsonl"))


def test_hub_layout_directories_and_their_splits(tmp_path):
    hub = tmp_path / "hub"
    parquet(hub / "data" / "train-00000-of-00001.parquet", ROWS[:2])
    parquet(hub / "data" / "test-00000-of-00001.parquet", ROWS[2:])
    (hub / "README.md").write_text("# a dataset card, not data\n")
    assert read_rows(hub)[0] == ROWS[:2] and read_rows(hub, "test")[0] == ROWS[2:]
    assert read_rows(hub, "test")[1] == [f"{hub}/data/test-00000-of-00001.parquet row 0"]
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "train.jsonl").write_bytes(lines(FLAT))
    (flat / "test.jsonl.gz").write_bytes(gzip.compress(lines(ROWS[:1])))
    assert read_rows(flat)[0] == FLAT and read_rows(flat, "test")[0] == ROWS[:1]
    with pytest.raises(DataFileError, match=r"holds the splits \['test', 'train'\] .*'validation'; name one"):
        read_rows(flat, "validation")
    with pytest.raises(DataFileError, match=r"holds the splits \['test', 'train'\] and the config says none"):
        read_rows(flat, None)


def test_save_to_disk_dataset_dict_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(FLAT), "test": datasets.Dataset.from_list(FLAT[:1])}
                         ).save_to_disk(str(tmp_path / "dd"))
    assert read_rows(tmp_path / "dd")[0] == FLAT
    rows, where = read_rows(tmp_path / "dd", "test")
    assert rows == FLAT[:1] and where == [f"{tmp_path / 'dd'}[test] row 0"]
    datasets.Dataset.from_list(FLAT).save_to_disk(str(tmp_path / "one"))
    assert read_rows(tmp_path / "one")[0] == FLAT
    datasets.DatasetDict({"a": datasets.Dataset.from_list(FLAT), "b": datasets.Dataset.from_list(FLAT)}
                         ).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(DataFileError, match=r"holds the splits \['a', 'b'\] and the config asks for 'train'"):
        read_rows(tmp_path / "ab")


def test_errors_name_the_file_and_say_the_fix(tmp_path):
    with pytest.raises(DataFileError, match=r"nope\.jsonl does not exist; give a JSON, JSONL, Parquet or CSV"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DataFileError, match=r"empty\.jsonl is empty: it has no rows"):
        read_rows(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps(FLAT[0]) + "\n\n" + '{"prompt": "1+1=", \n')
    with pytest.raises(DataFileError, match=r"bad\.jsonl:3: not valid JSON"):
        read_rows(tmp_path / "bad.jsonl")
    (tmp_path / "arr.jsonl").write_text("[1, 2]\n")
    with pytest.raises(DataFileError, match=r"arr\.jsonl:1: a JSON list, not an object"):
        read_rows(tmp_path / "arr.jsonl")
    (tmp_path / "nums.json").write_text("[{}, 3]")
    with pytest.raises(DataFileError, match=r"nums\.json row 1: a JSON int, not an object"):
        read_rows(tmp_path / "nums.json")
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(DataFileError, match=r"cannot read .*p\.txt: give a JSON, JSONL"):
        read_rows(tmp_path / "p.txt")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataFileError, match="not a readable Parquet file"):
        read_rows(tmp_path / "broken.parquet")
    (tmp_path / "fake.jsonl.gz").write_bytes(lines(FLAT))
    with pytest.raises(DataFileError, match=r"fake\.jsonl\.gz: cannot be read .*compression suffix"):
        read_rows(tmp_path / "fake.jsonl.gz")
    (tmp_path / "f.jsonl").write_bytes(lines(FLAT))
    with pytest.raises(DataFileError, match=r"f\.jsonl is a file, which holds one split \('train'\), not 'test'"):
        read_rows(tmp_path / "f.jsonl", "test")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("x")
    with pytest.raises(DataFileError, match=r"docs holds no JSON, JSONL, Parquet or CSV file \(it has a\.txt\)"):
        read_rows(tmp_path / "docs")


def test_rows_already_read_pass_through():
    rows = Rows(FLAT, ["x:1", "x:2"], "x")
    assert read_rows(rows) == (FLAT, ["x:1", "x:2"])
    picked = rows.select([1])
    assert picked.rows == FLAT[1:] and picked.where == ["x:2"] and str(picked) == "x"
