"""`python -m xray.export CHECKPOINT OUT_DIR [--role actor] [--model-dir DIR]`: a step checkpoint of
a run as a Hugging Face directory.

    python -m xray.export runs/ppo-1/checkpoints/step-000040 exported/step-40
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('exported/step-40')"

The command line of `xray.run.export.export_checkpoint` (read it for what is written): any step
checkpoint of either training backend, in any layout it was trained in, on a machine without GPUs,
Ray or the run's processes. Prints the written directory; a mistake is a one-line message and exit
code 2.
"""
from __future__ import annotations

import argparse
import logging
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xray.export", allow_abbrev=False,
                                description="Write a run's step checkpoint as a Hugging Face model directory.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a step checkpoint: RUN_DIR/checkpoints/step-N")
    p.add_argument("out", metavar="OUT_DIR", help="where to write the Hugging Face directory")
    p.add_argument("--role", default="actor", choices=("actor", "critic"), help="which trained model (default: actor)")
    p.add_argument("--model-dir", default=None,
                   help="the model directory the run started from (default: as the checkpoint records it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from xray.config import ConfigError
    from xray.run.export import ExportError, export_checkpoint

    try:
        written = export_checkpoint(args.checkpoint, args.out, args.role, args.model_dir)
    except (ExportError, ConfigError, FileNotFoundError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(f"{written}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
