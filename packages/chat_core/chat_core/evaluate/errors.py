"""The one error of ``evaluate``: the run can't start or go on."""

from __future__ import annotations


class EvaluateError(Exception):
    """The run can't start or go on: the rows, the output folder or the model endpoint is wrong; the message says
    which and what to do."""
