"""`python -m xray.check parity|sync ...`: checks users run on their own models and layouts.

    python -m xray.check parity --backend megatron --tp 2 --pp 1 --dp 1 [--model DIR]
    python -m xray.check parity --backend deepspeed --zero 3 --dp 2 [--model DIR]
    python -m xray.check sync --backend megatron-vllm [--tp 2] [--replicas 2] [--model DIR]

A layout or input error ends with a one-line message and exit code 2; a check outside its
tolerance ends with exit code 1.
"""
from __future__ import annotations

import argparse
import logging
import sys

from xray.backends import BackendError
from xray.config.parallel import LayoutError


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m xray.check", allow_abbrev=False)
    sub = parser.add_subparsers(dest="check", required=True)
    from xray.check import parity, sync

    parity.add_arguments(sub.add_parser("parity", help="a sharded backend against the unsharded HF model"))
    sync.add_arguments(sub.add_parser("sync", help="one verified weight sync, actor to rollout engine"))
    args = parser.parse_args(argv)
    try:
        if args.check == "parity":
            return parity.main(args)
        if args.check == "sync":
            return sync.main(args)
    except (LayoutError, BackendError, ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
