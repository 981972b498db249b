"""What ``evaluate`` reports of a run's records: per split the per-episode metrics both trainers log
(``chat_core.record.metrics``), pass@k and per-task rewards, written as ``DIR/summary.json`` and printed as a
table; and the change from another run."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from chat_core.record.metrics import episode_metrics, reward_mean_se
from chat_core.record.outcome import EpisodeOutcome

SUMMARY = "summary.json"
PASS_REWARD = 1.0
"""An episode passes, for pass@k, when it is scored and earns at least this: the env's full reward."""


def summarize(records: Sequence[Mapping[str, Any]], samples: int) -> dict[str, Any]:
    """Per split (in the order first seen): ``chat_core.record.metrics``' numbers, the episodes unscored by flag kind,
    ``turns_p50``, ``tool_calls_p50``, ``pass@k`` for each k up to ``samples`` (see ``pass_at_k``) and per task
    ``episodes``, ``reward_mean`` and ``reward_se`` over its scored episodes."""
    by_split: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        by_split[record["split"]].append(record)
    splits = {}
    for split, held in by_split.items():
        outcomes = [EpisodeOutcome.from_metadata(record) for record in held]
        metrics: dict[str, Any] = episode_metrics(outcomes, [1] * len(outcomes))
        metrics["unscored"] = dict(Counter(outcome.reason for outcome in outcomes if not outcome.scored))
        metrics["turns_p50"] = statistics.median(outcome.turns for outcome in outcomes)
        metrics["tool_calls_p50"] = statistics.median(outcome.tool_calls for outcome in outcomes)
        metrics["model_retries"] = sum(outcome.model_retries for outcome in outcomes)
        rows: dict[int, list[EpisodeOutcome]] = defaultdict(list)
        tasks: dict[str, list[EpisodeOutcome]] = defaultdict(list)
        for record, outcome in zip(held, outcomes, strict=True):
            rows[record["row"]].append(outcome)
            tasks[record["task"]].append(outcome)
        passes = [_passes(played) for played in rows.values()]
        for k in range(1, samples + 1):
            if (value := _pass_at(passes, k)) is not None:
                metrics[f"pass@{k}"] = value
        metrics["tasks"] = {task: _mean_se(played) for task, played in sorted(tasks.items())}
        splits[split] = metrics
    return {"samples": samples, "pass_reward": PASS_REWARD, "splits": splits}


def pass_at_k(rows: Any, k: int) -> float | None:
    """The unbiased pass@k estimate (Chen et al. 2021): over the rows with at least ``k`` scored episodes, the mean
    of 1 - C(n - c, k) / C(n, k) for a row's n scored episodes of which c pass; None when no row has k. Unscored
    episodes are left out, so a failed request never counts as a failed answer."""
    return _pass_at([_passes(outcomes) for outcomes in rows], k)


def _passes(outcomes: Sequence[EpisodeOutcome]) -> tuple[int, int]:
    """A row's scored episodes and how many of them pass: all ``pass_at_k`` reads of a row, counted once for
    every k rather than once per k."""
    scored = [outcome for outcome in outcomes if outcome.scored]
    return len(scored), sum(outcome.reward >= PASS_REWARD for outcome in scored)


def _pass_at(passes: Sequence[tuple[int, int]], k: int) -> float | None:
    estimates = [1 - math.comb(n - c, k) / math.comb(n, k) for n, c in passes if n >= k]
    return statistics.fmean(estimates) if estimates else None


def _mean_se(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    rewards = [outcome.reward for outcome in outcomes if outcome.scored and outcome.reward is not None]
    return {"episodes": float(len(outcomes)), **reward_mean_se(rewards)}


def table(summary: Mapping[str, Any]) -> str:
    """The summary as a person reads it: a block per split, then its tasks' mean rewards."""
    lines = []
    for split, metrics in summary["splits"].items():
        reward = _reward(metrics)
        passes = "  ".join(f"{name} {value:.3f}" for name, value in metrics.items() if name.startswith("pass@"))
        unscored = ", ".join(f"{kind} {count}" for kind, count in sorted(metrics["unscored"].items())) or "none"
        lines += [
            f"split {split}: {metrics['episodes']:.0f} episodes, reward {reward}, {passes}",
            f"  zero reward {metrics.get('zero_reward_share', 0):.1%} of scored; unscored: {unscored}; "
            f"model retries {metrics['model_retries']}",
            f"  turns p50 {metrics['turns_p50']:g} p90 {metrics['turns_p90']:g}; tool calls p50 "
            f"{metrics['tool_calls_p50']:g} p90 {metrics['tool_calls_p90']:g}; env {metrics['env_s_mean']:.2f} s, "
            f"model {metrics['model_s_mean']:.2f} s per episode",
            f"  cut short: full context {metrics['cut_short_share/context_exhausted']:.1%}, cut reply "
            f"{metrics['cut_short_share/response_limit']:.1%}; tool answers cut {metrics['tool_answers_cut_mean']:g} "
            "per episode",
        ]
        lines += [
            f"  {task}: {_reward(numbers)} ({numbers['episodes']:.0f})" for task, numbers in metrics["tasks"].items()
        ]
    return "\n".join(lines)


def compare(summary: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    """The change in mean reward from ``other``'s run to ``summary``'s, per split and per task both ran, with the
    standard error of the difference (the two runs' errors combined, as independent samples)."""
    lines = []
    for split, metrics in summary["splits"].items():
        before = other["splits"].get(split)
        if before is None:
            continue
        lines.append(f"split {split}: {_delta(metrics, before)}")
        for task, numbers in metrics["tasks"].items():
            if task in before["tasks"]:
                lines.append(f"  {task}: {_delta(numbers, before['tasks'][task])}")
    return "\n".join(lines) or "no split in common"


def _reward(numbers: Mapping[str, Any]) -> str:
    if "reward_mean" not in numbers:
        return "- (nothing scored)"
    return f"{numbers['reward_mean']:.3f} ± {numbers['reward_se']:.3f}"


def _delta(now: Mapping[str, Any], before: Mapping[str, Any]) -> str:
    if "reward_mean" not in now or "reward_mean" not in before:
        return "- (nothing scored in one of the runs)"
    delta = now["reward_mean"] - before["reward_mean"]
    return (
        f"{before['reward_mean']:.3f} → {now['reward_mean']:.3f}: {delta:+.3f} ± "
        f"{math.hypot(now['reward_se'], before['reward_se']):.3f}"
    )
