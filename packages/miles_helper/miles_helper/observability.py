"""Per-episode metrics in Miles' own tracking (``miles.utils.tracking_utils.tracking.log``, so wandb, TensorBoard and
Miles' other backends get them), through

    --custom-rollout-log-function-path miles_helper.log_rollout
    --custom-eval-rollout-log-function-path miles_helper.log_eval_rollout

Both return False, so Miles' default per-sample logging still runs beside them."""

from __future__ import annotations

from typing import Any

from chat_core.record import metrics
from miles.utils.metric_utils import compute_rollout_step
from miles.utils.tracking_utils import tracking


def log_rollout(rollout_id: int, args: Any, samples: list, rollout_extra_metrics: Any, rollout_time: float) -> bool:
    """Miles' ``--custom-rollout-log-function-path``: the step's per-episode metrics (``chat_core.record.metrics``)
    under ``rollout/episode/``, at Miles' own ``rollout/step``. Returns False so Miles' default logging runs too."""
    return metrics.log_rollout(samples, compute_rollout_step(args, rollout_id), _logger(args))


def log_eval_rollout(rollout_id: int, args: Any, data: dict[str, Any], extra_metrics: Any) -> bool:
    """Miles' ``--custom-eval-rollout-log-function-path``: each eval split's per-episode metrics under
    ``eval/<split>/episode/``, at Miles' own ``eval/step``; each eval sample is one episode. Returns False so
    Miles' default logging runs too."""
    return metrics.log_eval(data, compute_rollout_step(args, rollout_id), _logger(args))


def _logger(args: Any) -> metrics.StepLog:
    """Miles' own tracking (``tracking.log``: wandb, TensorBoard, its other backends) for the launch ``args``."""
    return lambda logged, step_key: tracking.log(args, logged, step_key=step_key)
