"""Plain text for continued pre-training (`python -m xray.train pt`, `algorithms/pt.py`).

Documents come from `data.path`: the `text` column (`pt.text_field`) of any data `xray.data.files`
reads (JSON, JSONL, Parquet or CSV files, compressed or not, lists and globs of them, hub-layout
and `datasets` directories), a `.txt` file (one document), a directory of `.txt` files (one
document each), or a built-in task (`builtin:arith`:
each row's prompt followed by its answer, `xray.builtin.sources.read_documents`, a layer above).
A seeded `pt.eval_fraction` of the documents is held out. Each split is tokenized, joined with
EOS after every document and cut into chunks of `pt.seq_len` tokens (the tail shorter than a
chunk is dropped), as pre-training packs its data.
"""
from __future__ import annotations

import random
from pathlib import Path

from xray.data.files import DataFileError, Source, is_glob, read_rows

TEXT_SUFFIXES = (".txt",)


class TextDataError(ValueError):
    """Text data that cannot be read or packed; says what to give instead."""


def file_documents(path: str | list[str], text_field: str) -> list[str]:
    """Every document of `path` (see the module docstring), in file order."""
    if isinstance(path, (list, tuple)) or is_glob(path):
        return _non_empty(_column(path, text_field), path)
    source = Path(path)
    if not source.exists():
        raise TextDataError(f"text data {source} does not exist; set data.path to a .txt file, a directory of "
                            f".txt files, data with a {text_field!r} column (JSON, JSONL, Parquet or CSV files, a "
                            "list or glob of them, a directory of them), or builtin:arith")
    if source.is_file() and source.suffix in TEXT_SUFFIXES:
        docs = [source.read_text(encoding="utf-8")]
    elif source.is_dir() and any(source.glob("*.txt")):
        docs = [p.read_text(encoding="utf-8") for p in sorted(source.glob("*.txt"))]
    else:
        docs = _column(source, text_field)
    return _non_empty(docs, source)


def _non_empty(docs: list[str], source: object) -> list[str]:
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise TextDataError(f"text data {source} holds no non-empty document")
    return docs


def _column(source: Source, text_field: str) -> list[str]:
    try:
        rows, where = read_rows(source)
    except DataFileError as exc:
        raise TextDataError(f"text data: {exc}") from None
    missing = [w for r, w in zip(rows, where) if not isinstance(r.get(text_field), str)]
    if missing:
        raise TextDataError(f"{missing[0]} has no text column {text_field!r} (a string); set pt.text_field to "
                            f"the column that holds the text (this row has {sorted(rows[0])})")
    return [r[text_field] for r in rows]


def split_documents(docs: list[str], eval_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, held out): a seeded `eval_fraction` of the documents held out (at least one when the
    fraction is above 0 and there are two or more documents)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise TextDataError(f"pt.eval_fraction={eval_fraction} must be in [0, 1)")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    held = 0 if eval_fraction == 0 or len(docs) < 2 else max(1, int(len(docs) * eval_fraction))
    return [docs[i] for i in sorted(order[held:])], [docs[i] for i in sorted(order[:held])]


def pack_documents(docs: list[str], tokenizer, seq_len: int) -> list[list[int]]:
    """The documents tokenized, each followed by EOS, joined and cut into `seq_len`-token chunks."""
    if seq_len < 2:
        raise TextDataError(f"pt.seq_len={seq_len}: a chunk needs at least 2 tokens")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TextDataError("the tokenizer has no EOS token to separate documents; save one with the tokenizer")
    stream: list[int] = []
    for doc in docs:
        stream.extend(tokenizer(doc, add_special_tokens=False).input_ids)
        stream.append(eos)
    return [stream[i:i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
