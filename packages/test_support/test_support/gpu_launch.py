"""The GPU runs' launches parsed on CPU, as the slime and Miles tiers parse them: a run's folder holding what the
trainer's ``parse_args`` reads of it, and the checks of the parse that hold for both trainers, since Miles parses
the evals and function paths as slime, which it forked, does.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .checkpoint import QWEN3_4B, weightless_checkpoint


def ready_to_parse(model: Path, rows: Path, splits: Iterable[str]) -> None:
    """A weightless Qwen3-4B checkpoint at ``model`` and an empty ``<split>.jsonl`` in ``rows`` for each of
    ``splits``: all the trainer's ``parse_args`` reads of a GPU run's folder."""
    weightless_checkpoint(model, QWEN3_4B)
    rows.mkdir()
    for split in splits:
        (rows / f"{split}.jsonl").write_text("")


def check_evals(args: Namespace, splits: Sequence[str], every: int) -> None:
    """Raises AssertionError unless the parsed ``args`` evaluate ``splits``, in order, once per task, every ``every``
    steps."""
    names = [dataset.name for dataset in args.eval_datasets]
    assert names == list(splits), f"evaluates {names}, not {list(splits)}"
    samples = {dataset.name: dataset.n_samples_per_eval_prompt for dataset in args.eval_datasets}
    assert set(samples.values()) == {1}, f"samples per eval task: {samples}"
    assert args.eval_interval == every, f"evaluates every {args.eval_interval} steps, not {every}"


def check_functions(args: Namespace, paths: Mapping[str, str], load_function: Callable[[str], Any]) -> None:
    """Raises AssertionError unless the parsed ``args`` hold each flag of ``paths`` (flag → import path) as given
    and ``load_function``, the trainer's loader, resolves each path to a callable."""
    parsed = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in paths}
    assert parsed == dict(paths), f"parsed {parsed}, not {dict(paths)}"
    uncallable = [path for path in paths.values() if not callable(load_function(path))]
    assert not uncallable, f"not callable: {uncallable}"
