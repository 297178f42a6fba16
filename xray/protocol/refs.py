"""Arguments passed by reference: the answer of a `flatten` call left in the object store as its
parts (object refs of equal-sized parts, in order) and given to another call. `remote_slices`
says which parts and rows each replica takes, as a `PartsSlice` that the receiving Workhorse
fetches and `assemble`s itself (`xray/protocol/__init__.py`). Pure functions, no Ray."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xray.data.batch import Batch
from xray.protocol.gather import concat
from xray.protocol.mark import DispatchError
from xray.protocol.scatter import select_columns


@dataclass(frozen=True)
class PartsSlice:
    """One replica's rows of an answer that stays in the object store as equal-sized parts.

    `parts` are the refs of the parts its rows lie in; of their concatenation it takes
    `part_rows * take / den` rows after skipping `part_rows * skip / den`."""

    parts: tuple
    skip: int
    take: int
    den: int
    columns: tuple[str, ...] | None = None


def remote_slices(num_parts: int, replicas: int) -> list[tuple[int, int, int, int, int]]:
    """For each of `replicas`: (first part, end part, skip, take, den) over `num_parts` equal parts."""
    out = []
    for d in range(replicas):
        lo, hi = d * num_parts, (d + 1) * num_parts  # in units of 1/replicas parts
        first, end = lo // replicas, -(-hi // replicas)
        out.append((first, end, lo - first * replicas, num_parts, replicas))
    return out


def assemble(values: list, piece: PartsSlice) -> Any:
    """The rows `piece` names, from the fetched values of its parts."""
    sizes = {len(v) for v in values}
    if len(sizes) != 1:
        raise DispatchError(f"parts passed by reference have different sizes {sorted(sizes)}; only equal "
                            "parts can be re-split (fetch the answer and pass it by value)")
    rows = sizes.pop()
    skip, take = rows * piece.skip, rows * piece.take
    if skip % piece.den or take % piece.den:
        raise DispatchError(f"{rows * len(values)} rows passed by reference do not split evenly over "
                            f"{piece.den} data-parallel replicas; pass a multiple of {piece.den} rows")
    joined = values[0] if len(values) == 1 else concat(values)
    skip, take = skip // piece.den, take // piece.den
    if skip or take != len(joined):
        joined = joined.index(slice(skip, skip + take)) if isinstance(joined, Batch) else joined[skip:skip + take]
    return select_columns(joined, piece.columns)
