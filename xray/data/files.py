"""Rows of data as users keep them: the one reader of data files under `xray/data` (prompts,
supervised rows, text), and of the train and eval sources one layer above (`xray.builtin.sources`).

A source is one of:
- a file: JSON (an array of objects, one object, or JSON lines), JSON lines (`.jsonl`, `.ndjson`),
  Parquet or CSV, each possibly compressed (`.gz`, `.bz2`, `.xz`, `.zst`);
- a list of sources, or a glob (`data/*.jsonl`, `MATH/train/**/*.json`), read in order;
- a directory in the Hugging Face hub layout (`data/train-00000-of-00001.parquet`, `train.jsonl` +
  `test.jsonl`, `train/` + `test/`): its split files are found by `datasets`' own rules, the ones
  `load_dataset` applies to a directory;
- a directory written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict: one split of it);
- `Rows` already read (handed back as they are).
`split` names the split of a directory; a file, list or glob is the one split `train`.

JSON is parsed by Python's `json`, not by Arrow, so rows come back exactly as written: Arrow would
unify each column's type (`"1"` and `2` both become integers) and give every row every key
(`None` where it had none, in chat messages too), and it cannot name the line of a bad row.
Parquet and CSV are read by pyarrow, the reader under `datasets`. Every row is a plain Python dict,
lists and structs kept as lists and dicts (veRL's `prompt` list of messages, its `reward_model`).
"""
from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Optional, Sequence, Union

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffix -> format."""
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
"""Compression suffixes read after the format's (`rows.jsonl.gz`)."""
FORMS = ("a JSON, JSONL, Parquet or CSV file (optionally .gz, .bz2, .xz or .zst), a list or glob of them, "
         "a directory of split files (train.jsonl, data/train-00000-of-00001.parquet, ...), or a directory "
         "written by datasets' save_to_disk")
"""What a source may be, for error messages."""
ONE_SPLIT = "train"
"""The split a file, list or glob holds (as `datasets` names it)."""


class DataFileError(ValueError):
    """Data that cannot be read; the message names the file (and line or row) and says the fix."""


Row = dict[str, Any]


@dataclass(frozen=True)
class Rows:
    """Rows already read, with where each came from (`file.jsonl:12`, `file.parquet row 11`)."""

    rows: list[Row]
    """The rows, as plain Python dicts."""
    where: list[str]
    """Where each row came from, for error messages."""
    name: str = "rows"
    """The source they were read from, for messages."""

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        return self.name

    def select(self, indices: Sequence[int]) -> "Rows":
        """The rows at `indices`, in that order."""
        return Rows([self.rows[i] for i in indices], [self.where[i] for i in indices], self.name)


Source = Union[str, Path, Sequence[Union[str, Path]], Rows]


def read_rows(source: Source, split: Optional[str] = ONE_SPLIT) -> tuple[list[Row], list[str]]:
    """The rows of `source` (see the module docstring) and where each came from. `split` chooses
    the split of a directory that holds several (None: the only one there is)."""
    if isinstance(source, Rows):
        return source.rows, source.where
    rows, where = _read(source, split)
    if not rows:
        raise DataFileError(f"{_name(source)} is empty: it has no rows; give data with at least one row")
    return rows, where


def is_glob(source: Any) -> bool:
    """Whether `source` is a glob pattern rather than a path that exists."""
    return isinstance(source, str) and any(c in source for c in "*?[") and not Path(source).exists()


def _name(source: Source) -> str:
    return str(list(map(str, source))) if isinstance(source, (list, tuple)) else str(source)


def _read(source: Source, split: Optional[str]) -> tuple[list[Row], list[str]]:
    if isinstance(source, (list, tuple)):
        if not source:
            raise DataFileError(f"an empty list of data files; give {FORMS}")
        return _concat(_read(item, split) for item in source)
    if is_glob(source):
        matches = sorted(glob(str(source), recursive=True))
        if not matches:
            raise DataFileError(f"{source} matches no file; give {FORMS}")
        return _concat(_read(m, split) for m in matches)
    path = Path(source)
    if not path.exists():
        raise DataFileError(f"{path} does not exist; give {FORMS}")
    if path.is_dir():
        saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        return _read_saved(path, split) if saved else _read_layout(path, split)
    _one_split(path, split)
    return read_file(path)


def _concat(parts: Iterable[tuple[list[Row], list[str]]]) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    where: list[str] = []
    for r, w in parts:
        rows.extend(r)
        where.extend(w)
    return rows, where


def _one_split(path: Path, split: Optional[str]) -> None:
    if split not in (None, ONE_SPLIT):
        raise DataFileError(f"{path} is a file, which holds one split ({ONE_SPLIT!r}), not {split!r}; name a "
                            "directory of split files, or another file for that split")


def _pick_split(path: Path, names: Sequence[str], split: Optional[str]) -> str:
    if split is None and len(names) == 1:
        return names[0]
    if split in names:
        return split
    asked = "says none" if split is None else f"asks for {split!r}"
    raise DataFileError(f"{path} holds the splits {sorted(names)} and the config {asked}; name one of them")


def _read_saved(path: Path, split: Optional[str]) -> tuple[list[Row], list[str]]:
    """A `datasets` save_to_disk directory: a Dataset (one split), or one split of a DatasetDict."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DataFileError(f"{path}: not a directory written by datasets' save_to_disk ({e}); write it "
                            "again with Dataset.save_to_disk, or give its data files") from None
    label = str(path)
    if isinstance(ds, datasets.DatasetDict):
        name = _pick_split(path, list(ds), split)
        ds, label = ds[name], f"{path}[{name}]"
    else:
        _one_split(path, split)
    rows = ds.to_list()
    return rows, [f"{label} row {i}" for i in range(len(rows))]


def _read_layout(path: Path, split: Optional[str]) -> tuple[list[Row], list[str]]:
    """A directory of data files, split by name as `datasets.load_dataset(path)` splits it."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        patterns = get_data_patterns(str(path.resolve()))
    except EmptyDatasetError:
        raise DataFileError(f"{path} holds no data file; give {FORMS}") from None
    found = DataFilesDict.from_patterns(patterns, base_path=str(path.resolve()))
    splits = {str(name): sorted(path / Path(f).relative_to(path.resolve()) for f in files if file_format(Path(f))[0])
              for name, files in found.items()}
    skipped = sorted({Path(f).name for files in found.values() for f in files if not file_format(Path(f))[0]})
    if skipped:
        log.info("%s: skipping files that are not data (%s)", path, ", ".join(skipped[:5]))
    splits = {name: files for name, files in splits.items() if files}
    if not splits:
        raise DataFileError(f"{path} holds no JSON, JSONL, Parquet or CSV file (it has {', '.join(skipped[:5])}); "
                            f"give {FORMS}")
    name = _pick_split(path, list(splits), split)
    return _concat(read_file(f) for f in splits[name])


def file_format(path: Path) -> tuple[Optional[str], str]:
    """(format, compression suffix) of a file by its name: `rows.jsonl.gz` is ("jsonl", ".gz")."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in COMPRESSIONS else ""
    return (FORMATS.get(suffixes[-1]) if suffixes else None), compression


def read_file(path: Path) -> tuple[list[Row], list[str]]:
    """The rows of one data file and where each came from."""
    fmt, compression = file_format(path)
    if fmt is None:
        raise DataFileError(f"cannot read {path}: give {FORMS}")
    if path.stat().st_size == 0:
        return [], []
    if fmt == "parquet":
        return _read_parquet(path, compression)
    with _open(path, compression) as stream:
        try:
            if fmt == "jsonl":
                return _read_json_lines(path, io.TextIOWrapper(stream, encoding="utf-8"))
            if fmt == "json":
                return _read_json(path, stream.read().decode("utf-8"))
            return _read_csv(path, stream)
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise DataFileError(f"{path}: cannot be read ({e}); check the file is whole and its name's "
                                "compression suffix matches how it was written") from None


def _open(path: Path, compression: str) -> BinaryIO:
    """`path` opened for reading bytes, decompressed per its suffix."""
    if compression == ".gz":
        import gzip
        return gzip.open(path, "rb")
    if compression == ".bz2":
        import bz2
        return bz2.open(path, "rb")
    if compression == ".xz":
        import lzma
        return lzma.open(path, "rb")
    if compression == ".zst":  # pyarrow's codec: no extra package (datasets needs `zstandard` for it)
        import pyarrow as pa
        try:
            with pa.input_stream(str(path), compression="zstd") as s:
                return io.BytesIO(s.read())
        except (pa.ArrowException, OSError) as e:
            raise DataFileError(f"{path}: not a readable zstd file ({e})") from None
    return path.open("rb")


def _read_json_lines(path: Path, lines: Iterable[str]) -> tuple[list[Row], list[str]]:
    rows, where = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFileError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                "each line must be one JSON object") from None
        if not isinstance(row, dict):
            raise DataFileError(f"{path}:{lineno}: a JSON {type(row).__name__}, not an object; "
                                'each line must be one JSON object such as {"prompt": "..."}')
        rows.append(row)
        where.append(f"{path}:{lineno}")
    return rows, where


def _read_json(path: Path, text: str) -> tuple[list[Row], list[str]]:
    """A JSON file: an array of objects, one object (one row: MATH keeps a problem per file), or
    JSON lines under a `.json` name (as many hub datasets keep them)."""
    if not text.strip():
        return [], []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # more than one value: JSON lines
            return _read_json_lines(path, text.splitlines())
        raise DataFileError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); a .json file "
                            "holds an array of objects, one object, or one object per line") from None
    if isinstance(data, dict):
        return [data], [str(path)]
    if not isinstance(data, list):
        raise DataFileError(f"{path}: a JSON {type(data).__name__}; a .json file holds an array of objects, "
                            "one object, or one object per line")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataFileError(f"{path} row {i}: a JSON {type(row).__name__}, not an object; the array must "
                                'hold one object per row such as {"prompt": "..."}')
    return data, [f"{path} row {i}" for i in range(len(data))]


def _read_parquet(path: Path, compression: str) -> tuple[list[Row], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if compression:
            with _open(path, compression) as stream:
                table = pq.read_table(pa.BufferReader(stream.read()))
        else:
            table = pq.read_table(path)
    except (pa.ArrowException, OSError, EOFError) as e:
        raise DataFileError(f"{path}: not a readable Parquet file ({e}); write it with "
                            "pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
    rows = table.to_pylist()
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def _read_csv(path: Path, stream: BinaryIO) -> tuple[list[Row], list[str]]:
    """A CSV file with a header line; column types inferred as pandas and `datasets` infer them."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    try:
        rows = pcsv.read_csv(stream).to_pylist()
    except pa.ArrowInvalid as e:
        raise DataFileError(f"{path}: not a readable CSV file ({e}); give a header line of column names, then "
                            "one line per row") from None
    return rows, [f"{path} row {i}" for i in range(len(rows))]
