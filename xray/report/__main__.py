"""`python -m xray.report RUN_DIR [--out DIR]`: write the report of a run (`xray.report.write`).

Prints the page's path; a directory that is not a run's output is an error that says so.
"""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xray.report",
                                     description="Write RUN_DIR/report/index.html: plots of the run's metrics "
                                                 "and the timeline of one step.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's output directory (--output-dir of xray.train)")
    parser.add_argument("--out", default=None, help="where to write the report (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from xray.report.write import ReportError, write_report

    try:
        page = write_report(args.run_dir, args.out)
    except ReportError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(f"{page}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
