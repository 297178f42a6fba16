"""Writing a dataset of row dicts as JSON lines or Parquet (what `xray.data.prompts` reads back).

The sample job writes its chosen responses through `RecordWriter`: rows go to `<file>.tmp` as they
come (JSON lines) or at the end (Parquet, one table), and the file takes its name only when the
writer closes without error, so a file of that name is always complete. Non-finite floats are
written as null (JSON has no NaN).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class RecordWriter:
    """Rows into `path`: Parquet when it ends in `.parquet`, JSON lines otherwise."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.parquet = self.path.suffix == ".parquet"
        self.rows = 0
        self._held: list[dict] = []
        self._file = None if self.parquet else open(self.tmp, "w")

    def write(self, rows: Iterable[dict]) -> None:
        for row in rows:
            row = _plain(row)
            if self.parquet:
                self._held.append(row)
            else:
                self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.rows += 1
        if self._file is not None:
            self._file.flush()

    def close(self) -> Path:
        """Finish the file and give it its name; returns the path."""
        if self.parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(self._held), self.tmp)
        else:
            self._file.close()
        self.tmp.replace(self.path)
        return self.path

    def abandon(self) -> None:
        """Drop the unfinished file (the run failed)."""
        if self._file is not None:
            self._file.close()
        self.tmp.unlink(missing_ok=True)
