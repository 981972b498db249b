"""An episode's outcome: the one record of how it went that both trainer helpers put in every sample of the
episode (under ``OUTCOME_KEY`` in the sample's metadata) and that their filters and metrics read back, so slime and
Miles describe an episode the same way.

The outcome is plain JSON data, since trainers copy, pickle and dump sample metadata; ``to_metadata`` writes it and
``from_metadata`` reads it back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from chat_core.record.results import EpisodeResult, Flag, FlagKind

_CUT_REPLY = frozenset({FlagKind.REPLY_TRUNCATED, FlagKind.RESPONSE_LIMIT})

OUTCOME_KEY = "episode_outcome"
"""The key of a sample's metadata that holds its episode's outcome."""


@dataclass(frozen=True)
class EpisodeOutcome:
    """How an episode went, as training and its logs need it.

    ``reward`` is None unless the episode can be trained on (``scored``); ``reason`` is then the kind of its first
    fatal flag. ``turns``, ``model_calls``, ``tool_calls`` and ``tool_errors`` count the whole episode; ``env_s``,
    ``model_s``, ``capacity_wait_s`` and ``wall_s`` are its seconds in env calls, waiting for the model, waiting for
    a free env session, and in all. ``truncated``: a reply was cut by the token limit (flagged ``reply_truncated``
    or ``response_limit``). ``env_server``: the env server that played it (a pool's replica, or the row's own
    server), None when none did. ``model_retries``: chat requests sent again after a transient failure.
    ``dropped_tool_calls``: tool calls the model made that were answered "not run" (past
    ``Limits.max_tool_calls_per_turn``, or after an ``end_turn`` in the same reply; in records written before every
    call reached the env, those slime's adapter didn't pass on). ``tool_answers_cut``: tool answers cut to
    ``Limits.max_tool_answer_chars``; ``tool_answer_bytes_cut``: what was cut of them, in UTF-8 bytes.
    ``resumed_calls``: model calls the trainer cut to update its weights that were asked again, the episode playing
    on; ``cut_tokens``: the tokens those calls had generated when cut, which the reply went on from (both a helper's
    count). ``turns_not_appended``: turns whose prompt couldn't be appended to the tokens of the turn before
    (flagged ``turn_not_appended``; a helper's count). A field added after a record was written reads 0 there."""

    reward: float | None
    scored: bool
    reason: str | None
    flags: tuple[Flag, ...]
    turns: int
    model_calls: int
    tool_calls: int
    tool_errors: int
    env_s: float
    model_s: float
    capacity_wait_s: float
    wall_s: float
    truncated: bool
    env_server: str | None
    model_retries: int = 0
    dropped_tool_calls: int = 0
    tool_answers_cut: int = 0
    tool_answer_bytes_cut: int = 0
    resumed_calls: int = 0
    cut_tokens: int = 0
    turns_not_appended: int = 0

    @classmethod
    def of(cls, result: EpisodeResult) -> EpisodeOutcome:
        """The outcome of a played episode."""
        fatal = [flag for flag in result.flags if flag.fatal]
        return cls(
            reward=result.reward if result.scored else None,
            scored=result.scored,
            reason=str(fatal[0].kind) if fatal else None,
            flags=tuple(result.flags),
            turns=len(result.turns),
            model_calls=sum(turn.model_calls for turn in result.turns),
            tool_calls=sum(turn.tool_calls for turn in result.turns),
            tool_errors=sum(turn.tool_errors for turn in result.turns),
            env_s=result.timings.env_s,
            model_s=result.timings.model_s,
            capacity_wait_s=result.timings.capacity_wait_s,
            wall_s=result.timings.wall_s,
            truncated=any(flag.kind in _CUT_REPLY for flag in result.flags),
            env_server=result.env_server,
            model_retries=result.model_retries,
            dropped_tool_calls=sum(turn.dropped_tool_calls for turn in result.turns),
            tool_answers_cut=result.tool_answers_cut,
            tool_answer_bytes_cut=result.tool_answer_bytes_cut,
        )

    @classmethod
    def aborted(cls, message: str) -> EpisodeOutcome:
        """The outcome of an episode the trainer cut short before it ended: unscored, flagged ``rollout_aborted``."""
        return cls.unplayed(FlagKind.ROLLOUT_ABORTED, message)

    @classmethod
    def unplayed(cls, kind: FlagKind, message: str) -> EpisodeOutcome:
        """The outcome of an episode that ended, as ``message`` says, before anything of it was recorded: unscored,
        flagged ``kind`` (a fatal one)."""
        flag = Flag(kind, message)
        return cls(None, False, str(flag.kind), (flag,), 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, False, None)

    def to_metadata(self) -> dict[str, Any]:
        """The outcome as JSON data, the value of ``OUTCOME_KEY`` in a sample's metadata. The fields are read one by
        one: ``dataclasses.asdict`` deep-copies every value, which cost as much as encoding evaluate's whole record."""
        metadata = {field.name: getattr(self, field.name) for field in fields(self)}
        metadata["flags"] = [flag.as_dict() for flag in self.flags]
        return metadata

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any] | None) -> EpisodeOutcome | None:
        """The outcome a sample's metadata holds, or None when it holds none (a sample no helper of ours wrote).
        Raises ValueError when ``OUTCOME_KEY`` holds something that isn't an outcome."""
        value = (metadata or {}).get(OUTCOME_KEY)
        if value is None:
            return None
        try:
            flags = tuple(Flag(FlagKind(flag["kind"]), flag["message"], flag.get("fatal")) for flag in value["flags"])
            return cls(**{**value, "flags": flags})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"metadata[{OUTCOME_KEY!r}] isn't an episode outcome ({e}): {value!r}") from None
