"""The parts of slime this helper uses, found and checked once per process by their names and parameters (never
by a version string), so a slime that lacks one fails at the first rollout with everything missing in one message,
not halfway through an episode."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from slime_helper.errors import UnsupportedSlime

SUPPORTED_SLIME = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
_SAMPLE_FIELDS = (
    "tokens",
    "response",
    "response_length",
    "loss_mask",
    "rollout_log_probs",
    "reward",
    "remove_sample",
    "status",
    "metadata",
)


@dataclass(frozen=True)
class Slime:
    """What the helper calls in slime."""

    OpenAIAdapter: type
    run_app_in_thread: Callable[..., Any]
    load_tokenizer: Callable[..., Any]
    Sample: type
    DynamicFilterOutput: type
    load_function: Callable[..., Any]
    trace_span: Callable[..., Any]
    log: Callable[..., Any]
    compute_rollout_step: Callable[..., Any]
    generate_rollout: Callable[..., Any]
    eval_rollout: Callable[..., Any]
    generate_rollout_fully_async: Callable[..., Any]
    call_dynamic_filter: Callable[..., Any]
    MetricGatherer: type
    RolloutFnTrainOutput: type
    parse_model_output: Callable[..., Any]
    GenerateState: type
    TrajectoryManager: type


@functools.cache
def slime() -> Slime:
    """The parts of the installed slime the helper uses. Raises UnsupportedSlime naming each part that is missing or
    takes other parameters, and the slime commit the helper is known to work with."""
    missing: list[str] = []
    adapter = _find("slime.agent.adapters", "OpenAIAdapter", missing)
    run_app = _find("slime.agent.aiohttp_threaded", "run_app_in_thread", missing)
    load_tokenizer = _find("slime.utils.processing_utils", "load_tokenizer", missing)
    sample = _find("slime.utils.types", "Sample", missing)
    filter_output = _find("slime.rollout.filter_hub.base_types", "DynamicFilterOutput", missing)
    load_function = _find("slime.utils.misc", "load_function", missing)
    trace_span = _find("slime.observability.trace_utils", "trace_span", missing)
    log = _find("slime.observability.logging_utils", "log", missing)
    rollout_step = _find("slime.observability.metric_utils", "compute_rollout_step", missing)
    rollout = _find("slime.rollout.sglang_rollout", "generate_rollout", missing)
    evaluation = _find("slime.rollout.sglang_rollout", "eval_rollout", missing)
    fully_async = _find("slime.rollout.fully_async_rollout", "generate_rollout_fully_async", missing)
    call_filter = _find("slime.rollout.filter_hub.base_types", "call_dynamic_filter", missing)
    gatherer = _find("slime.rollout.filter_hub.base_types", "MetricGatherer", missing)
    train_output = _find("slime.rollout.base_types", "RolloutFnTrainOutput", missing)
    parse_model_output = _find("slime.agent.parsing", "parse_model_output", missing)
    generate_state = _find("slime.rollout.sglang_rollout", "GenerateState", missing)
    trajectory_manager = _find("slime.agent.trajectory", "TrajectoryManager", missing)
    if trace_span is not None:
        missing += _lacking("slime.observability.trace_utils.trace_span", trace_span, ("target", "name", "attrs"))
    if log is not None:
        missing += _lacking("slime.observability.logging_utils.log", log, ("args", "metrics", "step_key"))
    if adapter is not None:
        where = "slime.agent.adapters.OpenAIAdapter"
        missing += _lacking(
            where,
            adapter,
            ("tokenizer", "sglang_url", "tool_parser", "reasoning_parser", "fork_threshold_tokens", "debug_callback"),
        )
        missing += _lacking(
            f"{where}.open_session", getattr(adapter, "open_session", None), ("sampling_defaults", "max_context_tokens")
        )
        missing += _lacking(
            f"{where}.finish_session",
            getattr(adapter, "finish_session", None),
            ("base_sample", "reward", "extra_metadata"),
        )
        missing += _lacking(f"{where}.drop_session", getattr(adapter, "drop_session", None), ("sid",))
        missing += _lacking(f"{where}._session_id", getattr(adapter, "_session_id", None), ("request", "body"))
        missing += _lacking(
            f"{where}._build_reply",
            getattr(adapter, "_build_reply", None),
            ("parsed", "raw_finish", "translated", "tools_schema"),
        )
        missing += _lacking(
            f"{where}._respond", getattr(adapter, "_respond", None), ("request", "body", "reply", "in_tok", "out_tok")
        )
        missing += _lacking(
            f"{where}._run_debug_callback",
            getattr(adapter, "_run_debug_callback", None),
            ("sid", "translated", "tools_schema", "manager_message", "turn"),
        )
    if trajectory_manager is not None:
        where = "slime.agent.trajectory.TrajectoryManager"
        missing += _lacking(where, trajectory_manager, ("fork_threshold_tokens",))
        missing += _lacking(
            f"{where}.record_turn",
            getattr(trajectory_manager, "record_turn", None),
            ("sid", "turn", "prompt_messages", "response_message", "metadata"),
        )
    for where, function in (
        ("slime.rollout.sglang_rollout.generate_rollout", rollout),
        ("slime.rollout.fully_async_rollout.generate_rollout_fully_async", fully_async),
    ):
        if function is not None:
            missing += _lacking(where, function, ("args", "rollout_id", "evaluation"))
    if evaluation is not None:
        missing += _lacking("slime.rollout.sglang_rollout.eval_rollout", evaluation, ("args", "rollout_id"))
    if gatherer is not None:
        missing += _lacking(
            "slime.rollout.filter_hub.base_types.MetricGatherer.on_dynamic_filter_drop",
            getattr(gatherer, "on_dynamic_filter_drop", None),
            ("reason",),
        )
    if train_output is not None:
        missing += _lacking("slime.rollout.base_types.RolloutFnTrainOutput", train_output, ("samples", "metrics"))
    if parse_model_output is not None:
        missing += _lacking(
            "slime.agent.parsing.parse_model_output",
            parse_model_output,
            ("raw_output", "tools_schema", "tool_parser_name", "reasoning_parser_name"),
        )
    if run_app is not None:
        missing += _lacking(
            "slime.agent.aiohttp_threaded.run_app_in_thread", run_app, ("host", "port", "thread_name", "runner_kwargs")
        )
    if filter_output is not None:
        missing += _lacking(
            "slime.rollout.filter_hub.base_types.DynamicFilterOutput", filter_output, ("keep", "reason")
        )
    if sample is not None:
        fields = {field.name for field in dataclasses.fields(sample)} if dataclasses.is_dataclass(sample) else set()
        missing += [f"slime.utils.types.Sample.{name}" for name in _SAMPLE_FIELDS if name not in fields]
        statuses = getattr(sample, "Status", None)
        missing += [
            f"slime.utils.types.Sample.Status.{name}"
            for name in ("COMPLETED", "ABORTED", "FAILED")
            if not hasattr(statuses, name)
        ]
    if missing:
        raise UnsupportedSlime(
            "this slime lacks what slime_helper uses: "
            + "; ".join(missing)
            + f". slime_helper works with slime at commit {SUPPORTED_SLIME} (github.com/THUDM/slime); install that "
            "commit or one whose agent adapter offers these"
        )
    return Slime(
        adapter,
        run_app,
        load_tokenizer,
        sample,
        filter_output,
        load_function,
        trace_span,
        log,
        rollout_step,
        rollout,
        evaluation,
        fully_async,
        call_filter,
        gatherer,
        train_output,
        parse_model_output,
        generate_state,
        trajectory_manager,
    )


def _find(module: str, name: str, missing: list[str]) -> Any:
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as e:
        missing.append(f"{module} (importing it fails: {e})")
        return None
    if found is None:
        missing.append(f"{module}.{name}")
    return found


def _lacking(where: str, function: Any, names: Iterable[str]) -> list[str]:
    """``where(name=…)`` for each of ``names`` that ``function`` doesn't take."""
    if function is None:
        return [where]
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return [f"{where} (its signature can't be read)"]
    return [f"{where}({name}=…)" for name in names if name not in parameters]
