"""``python -m chat_core.prepare URL OUT``: every split of the OpenEnv server at URL written as ``OUT/<split>.jsonl``
(``chat_core.prepare.write``), one line per split said on stderr."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from chat_core._cli import positive_int
from chat_core.errors import OpenEnvError
from chat_core.prepare.write import DEFAULT_CONCURRENCY, PrepareError, write_rows


def main(argv: list[str] | None = None) -> int:
    """The command: writes the rows and one summary line per split on stderr, and returns 0; or, on any refusal
    ``write_rows`` documents, says why on stderr and returns 1 with nothing written."""
    parser = argparse.ArgumentParser(
        prog="python -m chat_core.prepare",
        description="Write every split of an OpenEnv server of agentenv tasks as OUT/<split>.jsonl, one chat row "
        "per task, for slime or Miles (--input-key messages --metadata-key metadata).",
    )
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "out", type=Path, help="the folder to create; it must not exist (relative to where `bazel run` was called)"
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=DEFAULT_CONCURRENCY,
        help="probe episodes open at once, at most the server's max_concurrent_envs "
        f"(default {DEFAULT_CONCURRENCY}, the server's default)",
    )
    args = parser.parse_args(argv)
    args.out = Path(os.environ.get("BUILD_WORKING_DIRECTORY", ".")) / args.out
    began = time.monotonic()
    try:
        counts = asyncio.run(write_rows(args.url, args.out, concurrency=args.concurrency))
    except (OpenEnvError, PrepareError, OSError) as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 1
    for split, count in counts.items():
        print(f"prepare: split {split!r}: {count} rows in {args.out / f'{split}.jsonl'}", file=sys.stderr)
    print(f"prepare: done in {time.monotonic() - began:.1f} s", file=sys.stderr)
    return 0
