"""Plain text for `pt` (`xray.data.text`, a built-in task's through `xray.builtin.sources`): every source
form, the held-out split, packing into chunks."""
import json

import pytest

from xray.builtin.sources import read_documents
from xray.data.text import TextDataError, pack_documents, split_documents
from xray.data.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.unit


def test_every_source_form(tmp_path):
    (tmp_path / "one.txt").write_text("abc def")
    assert read_documents(str(tmp_path / "one.txt"), "text", tmp_path, 10) == ["abc def"]
    folder = tmp_path / "books"
    folder.mkdir()
    for name, text in (("b.txt", "second"), ("a.txt", "first"), ("c.txt", "  \n")):
        (folder / name).write_text(text)
    assert read_documents(str(folder), "text", tmp_path, 10) == ["first", "second"]  # sorted, blanks dropped
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(["x y", "z"])))
    assert read_documents(str(rows), "body", tmp_path, 10) == ["x y", "z"]
    docs = read_documents("builtin:arith", "text", tmp_path / "task", 200)
    assert len(docs) == 1000 and all("=" in d and d.split("=")[1].isdigit() for d in docs)


def test_errors_say_the_fix(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(TextDataError, match=r"set pt.text_field.*\['body'\]"):
        read_documents(str(rows), "text", tmp_path, 10)
    with pytest.raises(TextDataError, match="does not exist; set data.path"):
        read_documents(str(tmp_path / "nope.txt"), "text", tmp_path, 10)
    with pytest.raises(TextDataError, match="eval_fraction"):
        split_documents(["a", "b"], 1.0, 0)
    with pytest.raises(TextDataError, match="at least 2 tokens"):
        pack_documents(["abc"], build_char_tokenizer(), 1)


def test_split_is_seeded_and_holds_out_a_fraction():
    docs = [f"doc {i}" for i in range(50)]
    train, held = split_documents(docs, 0.1, seed=3)
    assert len(held) == 5 and len(train) == 45 and sorted(train + held) == sorted(docs)
    assert split_documents(docs, 0.1, seed=3) == (train, held) and split_documents(docs, 0.1, seed=4) != (train, held)
    assert split_documents(docs, 0.0, seed=3) == (docs, []) and split_documents(["one"], 0.5, 0) == (["one"], [])


def test_packing_joins_documents_with_eos_and_drops_the_tail():
    tok = build_char_tokenizer()
    ids = {c: tok.convert_tokens_to_ids(c) for c in "abcde"}
    eos = tok.eos_token_id
    chunks = pack_documents(["abc", "de"], tok, 3)
    assert chunks == [[ids["a"], ids["b"], ids["c"]], [eos, ids["d"], ids["e"]]]  # the final EOS is the tail
    assert pack_documents(["ab"], tok, 4) == []
