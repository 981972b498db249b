"""``python -m chat_core.evaluate ROWS --model-url URL --model NAME --out DIR``: the rows read, the run played
(``chat_core.evaluate.run``), its summary printed as a table (and the change from ``--compare``'s run)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chat_core._cli import positive_int
from chat_core._wire import parse_json
from chat_core.episode.chat import ChatEndpoint
from chat_core.episode_ref import EpisodeRef
from chat_core.evaluate.errors import EvaluateError
from chat_core.evaluate.run import DEFAULT_CONCURRENCY, Run, evaluate
from chat_core.evaluate.summary import SUMMARY, compare, table
from chat_core.limits import Limits


def main(argv: list[str] | None = None) -> int:
    """The command: plays the episodes, prints the table (and the comparison) on stdout and returns 0; or says why
    it can't on stderr, in one line, and returns 1."""
    args = _parser().parse_args(argv)
    here = Path(os.environ.get("BUILD_WORKING_DIRECTORY", "."))
    try:
        sampling = _object(args.sampling, "--sampling")
        if args.chat_template_kwargs is not None:
            sampling["chat_template_kwargs"] = _object(args.chat_template_kwargs, "--chat-template-kwargs")
        headers = {}
        if args.api_key_env:
            if not (key := os.environ.get(args.api_key_env)):
                raise EvaluateError(f"--api-key-env names {args.api_key_env}, which isn't set in the environment")
            headers["Authorization"] = f"Bearer {key}"
        run = Run(
            ChatEndpoint(args.model_url.rstrip("/") + "/chat/completions", args.model, headers),
            sampling,
            Limits(
                max_turns=args.max_turns,
                max_tool_calls_per_turn=args.max_tool_calls_per_turn,
                model_deadline_s=args.model_deadline,
                max_tool_answer_chars=args.max_tool_answer_chars,
                play_on_cut_reply=args.play_on_cut_reply,
                score_cut_short=args.score_cut_short,
            ),
            args.concurrency,
        )
        other = _summary_of(here / args.compare) if args.compare else None
        summary = asyncio.run(
            evaluate(
                read_rows(here / args.rows, args.split), run, here / args.out, samples=args.samples, resume=args.resume
            )
        )
    except (EvaluateError, OSError, ValueError) as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 1
    print(table(summary))
    if other is not None:
        print(f"\ncompared with {args.compare}:\n{compare(summary, other)}")
    return 0


def read_rows(path: Path, splits: Sequence[str] = ()) -> list[tuple[EpisodeRef, dict[str, Any]]]:
    """The rows at ``path`` (a ``prepare`` folder, whose every split is read unless ``splits`` names some, or one
    of its ``.jsonl`` files) as each row's episode and metadata. Raises EvaluateError when there is no such folder,
    file or split, or a line isn't a row ``prepare`` wrote."""
    if path.is_dir():
        found = {file.stem: file for file in sorted(path.glob("*.jsonl"))}
        if missing := [split for split in splits if split not in found]:
            raise EvaluateError(
                f"{path} has no split {', '.join(map(repr, missing))}; it has {', '.join(found) or 'none'}"
            )
        files = [found[split] for split in splits] if splits else list(found.values())
    elif path.is_file():
        if splits and list(splits) != [path.stem]:
            raise EvaluateError(f"{path} holds the split {path.stem!r} only; leave out --split or give the folder")
        files = [path]
    else:
        raise EvaluateError(f"{path} is neither a folder of rows nor a rows file; write them with chat_core.prepare")
    rows = []
    for file in files:
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            try:
                metadata = parse_json(line)["metadata"]
                rows.append((EpisodeRef.from_metadata(metadata), metadata))
            except (ValueError, KeyError, TypeError) as e:
                raise EvaluateError(f"{file}:{number} isn't a row written by chat_core.prepare ({e})") from None
    if not rows:
        raise EvaluateError(f"{path} holds no rows")
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m chat_core.evaluate",
        description="Play the episodes of chat_core.prepare's rows against an OpenAI-compatible chat endpoint and "
        "report the model's reward per split and task.",
    )
    parser.add_argument("rows", type=Path, help="a folder written by chat_core.prepare, or one of its .jsonl files")
    parser.add_argument("--model-url", required=True, help="the endpoint's OpenAI base URL, e.g. http://host:30000/v1")
    parser.add_argument("--model", required=True, help="the model name the requests' body gives")
    parser.add_argument("--out", type=Path, required=True, help="the folder for episodes.jsonl and summary.json")
    parser.add_argument("--split", action="append", default=[], help="a split to play (repeatable; default: all)")
    parser.add_argument("--api-key-env", help="the environment variable holding the API key, sent as a bearer token")
    parser.add_argument("--samples", type=positive_int, default=1, help="episodes per row, for pass@k (default 1)")
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=DEFAULT_CONCURRENCY,
        help=f"episodes at once (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument("--sampling", default="{}", help='JSON for the request body, e.g. {"temperature": 0.6}')
    parser.add_argument(
        "--chat-template-kwargs", help='JSON sent as chat_template_kwargs, e.g. {"enable_thinking": false}'
    )
    defaults = Limits()
    parser.add_argument("--max-turns", type=positive_int, default=defaults.max_turns)
    parser.add_argument("--max-tool-calls-per-turn", type=positive_int, default=defaults.max_tool_calls_per_turn)
    parser.add_argument("--model-deadline", type=float, default=defaults.model_deadline_s, help="seconds per episode")
    parser.add_argument(
        "--max-tool-answer-chars",
        type=positive_int,
        default=defaults.max_tool_answer_chars,
        help=f"a longer tool answer is cut there, with a line saying so (default {defaults.max_tool_answer_chars:,})",
    )
    parser.add_argument(
        "--play-on-cut-reply",
        action="store_true",
        help="play a reply cut at max_tokens as it came, instead of ending its episode there",
    )
    parser.add_argument(
        "--score-cut-short",
        action="store_true",
        help="score an episode ended by a full context or a cut reply as it stands, instead of leaving it unscored",
    )
    parser.add_argument("--resume", action="store_true", help="play only the episodes DIR/episodes.jsonl lacks")
    parser.add_argument("--compare", type=Path, help="an earlier run's folder, whose rewards to print the change from")
    return parser


def _object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = parse_json(text)
    except ValueError as e:
        raise EvaluateError(f"{flag} isn't JSON ({e}): {text}") from None
    if not isinstance(value, dict):
        raise EvaluateError(f"{flag} must be a JSON object, not {text}")
    return value


def _summary_of(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EvaluateError(f"--compare {run}: no summary of a finished run there ({e})") from None
