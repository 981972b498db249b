"""An episode seen where slime users already look: its spans on the sample's trace (``slime.observability.
trace_utils``), which ``--save-debug-rollout-data`` dumps and ``tools/trace_timeline_viewer.py`` draws, and its
per-episode metrics in slime's own logger (``logging_utils.log``, so wandb and TensorBoard get them), through

    --custom-rollout-log-function-path slime_helper.log_rollout
    --custom-eval-rollout-log-function-path slime_helper.log_eval_rollout

Both log functions return False, so slime's default per-sample logging still runs beside them."""

from __future__ import annotations

import contextlib
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

from chat_core.record import metrics

from slime_helper._slime import slime


class SampleTrace:
    """``chat_core.play``'s episode spans, each recorded on ``sample``'s trace as a slime span named
    ``episode/<span>``."""

    def __init__(self, sample: Any):
        self._sample = sample

    @contextlib.contextmanager
    def span(self, name: str, attrs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        end: dict[str, Any] = {}
        with slime().trace_span(self._sample, f"episode/{name}", attrs=attrs) as span:
            try:
                yield end
            finally:
                if end:
                    span.update(end)


def log_rollout(
    rollout_id: int, args: Namespace, samples: list, rollout_extra_metrics: Any, rollout_time: float
) -> bool:
    """slime's ``--custom-rollout-log-function-path``: the step's per-episode metrics (``chat_core.record.metrics``)
    under ``rollout/episode/``, at slime's own ``rollout/step``. Returns False so slime's default logging runs too."""
    api = slime()
    return metrics.log_rollout(samples, api.compute_rollout_step(args, rollout_id), _logger(args))


def log_eval_rollout(rollout_id: int, args: Namespace, data: dict[str, Any], extra_metrics: Any) -> bool:
    """slime's ``--custom-eval-rollout-log-function-path``: each eval split's per-episode metrics under
    ``eval/<split>/episode/``, at slime's own ``eval/step``; each eval sample is one episode. Returns False so
    slime's default logging runs too."""
    api = slime()
    return metrics.log_eval(data, api.compute_rollout_step(args, rollout_id), _logger(args))


def _logger(args: Namespace) -> metrics.StepLog:
    """slime's own logger (``logging_utils.log``: wandb, TensorBoard) for the launch ``args``."""
    return lambda logged, step_key: slime().log(args, logged, step_key=step_key)
