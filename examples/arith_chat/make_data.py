"""Writes the quickstart's data (docs/quickstart.md, "Your model, your data, your reward"):
`train.jsonl` and `test.jsonl` beside this file, chat prompts of small additions in the form users
keep math data (veRL's and TRL's: `prompt` a list of messages, `answer` a GSM8K-style `#### N`
rationale, `data_source` naming the set). Seeded; the test pairs never appear in training.

    python examples/arith_chat/make_data.py
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"{a} + {b} = ?"}],
            "answer": f"{a} + {b} = {a + b}\n#### {a + b}", "data_source": "arith_chat"}


def main() -> None:
    pairs = [(a, b) for a in range(1, 20) for b in range(1, 10)]
    random.Random(0).shuffle(pairs)
    test, train = pairs[:48], pairs[48:]
    for name, rows in (("train", train), ("test", test)):
        with open(HERE / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row(a, b)) + "\n" for a, b in rows)
        print(f"wrote {len(rows)} rows to {HERE / name}.jsonl")


if __name__ == "__main__":
    main()
