"""Per-episode metrics of a rollout step or an eval split, counted once per episode however many samples it came
back as: the numbers both helpers' rollout-log functions hand to their trainer's own logger, at the trainer's own
step (``log_rollout``, ``log_eval``)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from chat_core.record.outcome import EpisodeOutcome
from chat_core.record.results import CUT_SHORT

ROLLOUT_STEP = "rollout/step"
EVAL_STEP = "eval/step"
StepLog = Callable[[dict[str, float], str], None]
"""A trainer's logger as the log functions call it: the metrics, and the name of the step they are logged at."""


def episode_metrics(outcomes: Sequence[EpisodeOutcome], samples: Sequence[int]) -> dict[str, float]:
    """The metrics of the episodes ``outcomes``, whose samples number ``samples`` (one count per episode), under
    names relative to the caller's prefix:

    - ``episodes``; ``samples_per_episode``;
    - ``reward_mean`` and ``reward_se`` (its standard error) over the scored episodes, ``zero_reward_share`` (the
      share of scored episodes earning 0), ``scored_share``;
    - ``unscored_share/<kind>``: the share of episodes left unscored for each reason;
    - ``truncated_share``: the share of episodes with a reply cut by the token limit;
    - ``cut_short_share/<kind>``: the share of episodes cut short by a full context (``context_exhausted``) or a
      cut reply (``response_limit``), scored or not;
    - ``turns``, ``tool_calls``, ``tool_errors``, ``dropped_tool_calls``, ``tool_answers_cut``,
      ``turns_not_appended``, ``resumed_calls`` (model calls a weight update cut that were asked again),
      ``cut_tokens`` (the tokens they had generated when cut): ``…_mean`` and ``…_p90`` per episode;
    - ``tool_answer_bytes_cut_mean``: what was cut of the tool answers, in bytes per episode;
    - ``env_s_mean``, ``model_s_mean``, ``capacity_wait_s_mean``, ``wall_s_mean``: seconds per episode.

    Raises ValueError when there are no episodes or the sample counts don't match them."""
    if not outcomes or len(samples) != len(outcomes):
        raise ValueError(f"{len(outcomes)} episodes with {len(samples)} sample counts; need one count per episode")
    episodes = len(outcomes)
    rewards = [outcome.reward for outcome in outcomes if outcome.scored and outcome.reward is not None]
    metrics: dict[str, float] = {
        "episodes": float(episodes),
        "samples_per_episode": sum(samples) / episodes,
        "scored_share": len(rewards) / episodes,
        "truncated_share": sum(outcome.truncated for outcome in outcomes) / episodes,
    }
    metrics.update(reward_mean_se(rewards))
    if rewards:
        metrics["zero_reward_share"] = sum(reward == 0 for reward in rewards) / len(rewards)
    for reason, count in Counter(outcome.reason for outcome in outcomes if not outcome.scored).items():
        metrics[f"unscored_share/{reason}"] = count / episodes
    for kind in sorted(CUT_SHORT):
        cut_short = sum(any(flag.kind == kind for flag in outcome.flags) for outcome in outcomes)
        metrics[f"cut_short_share/{kind}"] = cut_short / episodes
    for name in (
        "turns",
        "tool_calls",
        "tool_errors",
        "dropped_tool_calls",
        "tool_answers_cut",
        "resumed_calls",
        "cut_tokens",
        "turns_not_appended",
    ):
        values = [getattr(outcome, name) for outcome in outcomes]
        metrics[f"{name}_mean"] = statistics.fmean(values)
        metrics[f"{name}_p90"] = _p90(values)
    for name in ("tool_answer_bytes_cut", "env_s", "model_s", "capacity_wait_s", "wall_s"):
        metrics[f"{name}_mean"] = statistics.fmean(getattr(outcome, name) for outcome in outcomes)
    return metrics


def reward_mean_se(rewards: Sequence[float]) -> dict[str, float]:
    """``reward_mean`` of ``rewards`` and ``reward_se``, its standard error (0 for one reward); nothing for none."""
    if not rewards:
        return {}
    spread = statistics.stdev(rewards) / math.sqrt(len(rewards)) if len(rewards) > 1 else 0.0
    return {"reward_mean": statistics.fmean(rewards), "reward_se": spread}


def _p90(values: Sequence[float]) -> float:
    """The 90th percentile, by nearest rank."""
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)])


def rollout_of(sample: Any) -> Any:
    """The episode a trainer's training sample belongs to: its ``rollout_id``, which slime's adapter and Miles give
    every sample of an episode, or its ``index`` where the trainer left that unset."""
    return sample.rollout_id if sample.rollout_id is not None else sample.index


def sample_metrics(samples: Sequence[Any], episode_of: Callable[[Any], Any]) -> dict[str, float]:
    """``episode_metrics`` of the episodes a trainer's ``samples`` hold (``episode_of`` says which one a sample
    belongs to), each counted once however many samples it has; samples without an outcome are left out, and no
    outcome at all gives no metrics."""
    episodes: dict[Any, tuple[EpisodeOutcome, int]] = {}
    for sample in samples:
        outcome = EpisodeOutcome.from_metadata(sample.metadata)
        if outcome is None:
            continue
        key = episode_of(sample)
        _, seen = episodes.get(key, (outcome, 0))
        episodes[key] = (outcome, seen + 1)
    if not episodes:
        return {}
    outcomes, counts = zip(*episodes.values(), strict=True)
    return episode_metrics(list(outcomes), list(counts))


def rollout_log_metrics(samples: Sequence[Any]) -> dict[str, float]:
    """A rollout step's per-episode metrics under ``rollout/episode/``, from the training samples a trainer hands
    its rollout-log function (an episode's samples share its ``rollout_id``)."""
    return {f"rollout/episode/{name}": value for name, value in sample_metrics(samples, rollout_of).items()}


def eval_log_metrics(data: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Each eval split's per-episode metrics under ``eval/<split>/episode/``, from the ``{split: {"samples": …}}``
    a trainer hands its eval-log function, where each sample is one episode."""
    return {
        f"eval/{split}/episode/{name}": value
        for split, evaluated in data.items()
        for name, value in sample_metrics(evaluated.get("samples") or (), id).items()
    }


def log_rollout(samples: Sequence[Any], step: int, log: StepLog) -> bool:
    """A trainer's rollout-log function: hand ``log`` the step's per-episode metrics (``rollout_log_metrics``) at
    ``rollout/step`` ``step``. Returns False, so the trainer's default per-sample logging runs too."""
    log({**rollout_log_metrics(samples), ROLLOUT_STEP: step}, ROLLOUT_STEP)
    return False


def log_eval(data: Mapping[str, Mapping[str, Any]], step: int, log: StepLog) -> bool:
    """A trainer's eval-log function: hand ``log`` each split's per-episode metrics (``eval_log_metrics``) at
    ``eval/step`` ``step``, when any sample holds an outcome. Returns False, so the trainer's default logging runs
    too."""
    if metrics := eval_log_metrics(data):
        log({**metrics, EVAL_STEP: step}, EVAL_STEP)
    return False
