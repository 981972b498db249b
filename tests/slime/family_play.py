"""What the slime tier's tests of every model family share: rows of tasks of their own served with the sample
bundle's warehouse, each family's launch parsed by slime's own ``parse_args`` with its real tokenizer and chat
template, the stand-in for SGLang writing replies as the family's template writes them, and the one sample the model
calls of an episode rendered append-only make."""

from __future__ import annotations

import asyncio
import json
import shutil
from argparse import Namespace
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from chat_core.prepare import write_rows
from launch import parse_slime_args, slime_command
from sglang_stand_in import Generated, StandInSGLang
from test_support import SAMPLE_BUNDLE, serve_bundle
from test_support.families import Family, Mode, written
from test_support.script import Reply

FamilyLaunch = Callable[[Family, Mode, bool], tuple[Namespace, Any]]
"""A family's launch in a mode, with or without its reasoning parser: slime's arguments and the family's
tokenizer as slime loads it."""


@contextmanager
def served_rows(folder: Path, tasks: Mapping[str, list[dict[str, Any]]]) -> Iterator[Path]:
    """The ``all.jsonl`` rows of a server serving ``tasks`` (name → the task's steps) with the sample bundle's
    warehouse and verifier scripts, on a server of its own, while the ``with`` body runs."""
    bundle = folder / "bundle"
    (bundle / "tasks").mkdir(parents=True)
    shutil.copytree(SAMPLE_BUNDLE / "envs", bundle / "envs")
    shutil.copytree(SAMPLE_BUNDLE / "artifacts", bundle / "artifacts")
    for name, steps in tasks.items():
        (bundle / "tasks" / f"{name}.json").write_text(json.dumps(steps))
    with serve_bundle(bundle) as served:
        asyncio.run(write_rows(served.url, folder / "rows", progress=False))
        yield folder / "rows" / "all.jsonl"


def family_launcher(
    folder: Path,
    rows: Path,
    sglang: StandInSGLang,
    checkpoints: Callable[[Family], tuple[Path, Any]],
    config: str,
) -> FamilyLaunch:
    """Each family's launch on ``rows`` with the ``--custom-config-path`` YAML ``config``, against ``sglang``, from
    the checkpoint and tokenizer ``checkpoints`` gives (the tier's ``family_checkpoints``). slime's ``parse_args``
    reads each family's launch (its checkpoint, tool-call parser and config) once; a mode sets what
    ``--apply-chat-template-kwargs`` and ``--sglang-reasoning-parser`` would."""
    custom = folder / "custom.yaml"
    custom.write_text(config)
    parsed: dict[str, tuple[Namespace, Any]] = {}

    def launch(family: Family, mode: Mode, reasoning_parser: bool) -> tuple[Namespace, Any]:
        if family.name not in parsed:
            checkpoint, tokenizer = checkpoints(family)
            flags = ["--sglang-tool-call-parser", family.tool_parser, "--custom-config-path", str(custom)]
            args = parse_slime_args(slime_command(checkpoint, (sglang.host, sglang.port), rows, {}, *flags))
            parsed[family.name] = args, tokenizer
        args, tokenizer = parsed[family.name]
        moded = {
            "apply_chat_template_kwargs": dict(mode.template_kwargs),
            "sglang_reasoning_parser": family.reasoning_parser if reasoning_parser else None,
        }
        return Namespace(**{**vars(args), **moded}), tokenizer

    return launch


def reasoning_of(reply: Reply) -> str:
    """What the model thinks before ``reply``."""
    about = reply.tool_calls[0].name if reply.tool_calls else "the answer"
    return f"I should give {about} next."


def writes_as(tokenizer: Any, family: Family, mode: Mode) -> Callable[[Reply], list[int]]:
    """The stand-in's ``writes`` for a model of ``family`` in ``mode``: a reply's tokens as its template writes it,
    its reasoning (``reasoning_of``) first when the mode thinks."""

    def writes(reply: Reply) -> list[int]:
        return tokenizer.encode(written(tokenizer, family, mode, reply, reasoning_of(reply)), add_special_tokens=False)

    return writes


def sessions_of(generated: Sequence[Generated], tokenizer: Any, prompt: str) -> list[list[Generated]]:
    """The stand-in's replies to the episodes whose first prompt holds ``prompt`` (a task's), one list per session,
    in the order each session's first was answered; a request of another test that arrives late is no such reply."""
    sessions: dict[str, list[Generated]] = {}
    for reply in generated:
        sessions.setdefault(reply.routing_key, []).append(reply)
    return [replies for replies in sessions.values() if prompt in tokenizer.decode(replies[0].prompt)]


def whole_episode(replies: list[Generated]) -> tuple[list[int], list[int], list[float]]:
    """The tokens of an episode whose model calls were ``replies``, rendered append-only, its last prompt and reply;
    and the loss mask and logprobs of everything past its first prompt: 1 and the model's logprob on every token it
    generated, 0 elsewhere."""
    tokens = [*replies[-1].prompt, *replies[-1].output]
    mask, logprobs = [0] * len(tokens), [0.0] * len(tokens)
    for reply in replies:
        start = len(reply.prompt)
        assert tokens[: start + len(reply.output)] == [*reply.prompt, *reply.output], "a prompt forked"
        mask[start : start + len(reply.output)] = [1] * len(reply.output)
        logprobs[start : start + len(reply.output)] = reply.logprobs
    first = len(replies[0].prompt)
    return tokens, mask[first:], logprobs[first:]
