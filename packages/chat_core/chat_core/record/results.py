"""How a played episode went: its flags (what went wrong, and whether that leaves it unscored), each turn's counts,
its timings, and the result ``chat_core.play`` returns. Plain data with no network code, so the episode record, the
filters and the metrics read it without loading a client."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chat_core.episode_ref import EpisodeRef


class FlagKind(StrEnum):
    """What went wrong in an episode. Noted while the episode goes on:

    - ``bad_tool_arguments``: a tool call's arguments weren't a JSON object; the model got a tool error instead.
    - ``tool_call_limit``: the model called more tools in a turn than allowed; the turn ended with its latest text.
    - ``reply_truncated``: a reply stopped at the model's token limit (finish reason ``length``) and, as
      ``Limits.play_on_cut_reply`` asks, was played as it came, so the reward may be for a cut answer or a cut tool
      call.
    - ``tool_calls_dropped``: slime's adapter passed on only the first of a reply's tool calls, so the env never ran
      the others (slime_helper's flag until it passed every call on; read back from the records of that time only).
    - ``turn_not_appended``: a turn's prompt couldn't be appended to the tokens of the turn before, so the trainer's
      chat endpoint rendered its whole chat, and the trainer may have started a new sample of the episode there
      (a helper's flag; slime's fully-async rollout, which takes one sample per episode, also flags the episode
      ``episode_split`` when it did).
    - ``turn_not_recorded``: the helper failed to hold a turn the trainer recorded for the next turn's prompt, so
      the next turn couldn't be appended (a helper's flag; the trainer only logs the failure).

    Fatal (in ``FATAL``), leaving the episode unscored:

    - ``env_failed``: the env's run failed (at reset, in a turn or in a verifier); the message is the server's.
    - ``session_failed``: the chat endpoint failed: an HTTP error, no connection, an answer longer than
      ``Limits.max_chat_answer_bytes``, an unreadable reply (429, 502, 503, 504 and refused connections only once
      retrying them would pass the model deadline).
    - ``reply_aborted``: the model's server aborted a reply while generating it (finish reason ``abort``, as SGLang
      answers when the trainer pauses or aborts its engines); the episode ends there rather than play on from a cut
      reply. slime's helper asks a model call that a weight update cut again instead, so there it means the
      trainer's rollout was over.
    - ``no_reward``: the env ended the episode without a reward.
    - ``model_deadline``: the model took longer than ``Limits.model_deadline_s`` in all.
    - ``turn_limit``: the env opened more turns than ``Limits.max_turns``.
    - ``capacity_exhausted``: the env server stayed full for ``Limits.capacity_wait_s``.
    - ``env_deadline``: an env call (reset, list_tools, a tool call, end_turn with its verifiers) went unanswered
      for ``Limits.env_call_deadline_s``; the session was closed, abandoning the episode.
    - ``env_unreachable``: the env server couldn't be reached.
    - ``protocol_error``: the env server answered outside the protocol, sent more than ``Limits.max_env_message_bytes``
      in one message, stopped answering the session's pings, or dropped the session.
    - ``task_mismatch``: the server serves another task at the row's place; the rows are stale.
    - ``rollout_aborted``: the trainer aborted the rollout while the episode was playing (a helper's flag; ``play``
      itself is cancelled then).
    - ``episode_split``: the trainer's chat endpoint recorded the episode as several samples where the trainer's
      rollout takes one sample per episode (a helper's flag: slime's fully-async rollout).
    - ``chat_template_failed``: the model's chat template raised on the episode's chat, so the turn never reached
      the model; the message is the template's (a helper's flag, in place of the ``session_failed`` its chat
      endpoint's refusal raised).
    - ``resume_limit``: the trainer updated the weights in the middle of more of the episode's model calls than the
      helper asks again (slime's ``episode_max_resumed_calls``), so the episode ended at the last cut rather than
      grow staler (a helper's flag, in place of the ``reply_aborted`` of that cut).
    - ``episode_raised``: the episode raised where it should have ended in a flag (a fault of the trainer helper, the
      trainer or the row); the message names the exception (a helper's flag, where the trainer's rollout would only
      log it).

    Cutting an episode short (``CUT_SHORT``), fatal unless ``Limits.score_cut_short`` has the env score the episode
    as it stands (each flag says which, ``Flag.fatal``):

    - ``context_exhausted``: the episode's next prompt didn't fit the model's context (the chat endpoint refused
      it as too long, or ``Limits.max_context_tokens`` was reached); it ended there, with no further model call.
    - ``response_limit``: a reply stopped at the model's token limit (finish reason ``length``); the episode ended
      there, its tool calls not run."""

    BAD_TOOL_ARGUMENTS = "bad_tool_arguments"
    TOOL_CALL_LIMIT = "tool_call_limit"
    REPLY_TRUNCATED = "reply_truncated"
    TOOL_CALLS_DROPPED = "tool_calls_dropped"
    ENV_FAILED = "env_failed"
    SESSION_FAILED = "session_failed"
    REPLY_ABORTED = "reply_aborted"
    NO_REWARD = "no_reward"
    MODEL_DEADLINE = "model_deadline"
    TURN_LIMIT = "turn_limit"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    ENV_DEADLINE = "env_deadline"
    ENV_UNREACHABLE = "env_unreachable"
    PROTOCOL_ERROR = "protocol_error"
    TASK_MISMATCH = "task_mismatch"
    ROLLOUT_ABORTED = "rollout_aborted"
    EPISODE_SPLIT = "episode_split"
    CHAT_TEMPLATE_FAILED = "chat_template_failed"
    CONTEXT_EXHAUSTED = "context_exhausted"
    RESPONSE_LIMIT = "response_limit"
    RESUME_LIMIT = "resume_limit"
    EPISODE_RAISED = "episode_raised"
    TURN_NOT_APPENDED = "turn_not_appended"
    TURN_NOT_RECORDED = "turn_not_recorded"


CUT_SHORT = frozenset({FlagKind.CONTEXT_EXHAUSTED, FlagKind.RESPONSE_LIMIT})
"""The kinds that end an episode before the env ended it: in ``FATAL``, and noted instead where the launch has the
env score such an episode as it stands."""
FATAL = frozenset(FlagKind) - {
    FlagKind.BAD_TOOL_ARGUMENTS,
    FlagKind.TOOL_CALL_LIMIT,
    FlagKind.REPLY_TRUNCATED,
    FlagKind.TOOL_CALLS_DROPPED,
    FlagKind.TURN_NOT_APPENDED,
    FlagKind.TURN_NOT_RECORDED,
}


@dataclass(frozen=True)
class Flag:
    """Something that went wrong in an episode, with what a person needs to find it, and whether it leaves the
    episode unscored (``fatal``): when not given, whether its kind is in ``FATAL``."""

    kind: FlagKind
    message: str
    fatal: bool | None = None

    def __post_init__(self) -> None:
        if self.fatal is None:
            object.__setattr__(self, "fatal", self.kind in FATAL)

    def as_dict(self) -> dict[str, Any]:
        """The flag as plain JSON data, the shape trainers keep in a sample's metadata."""
        return {"kind": str(self.kind), "message": self.message, "fatal": self.fatal}


@dataclass
class TurnCounts:
    """One env turn: the model's replies, the tool calls answered (``end_turn`` aside), how many of them were errors
    (the env's, or arguments refused before reaching it), and the calls the model made that were answered "not run"
    (``dropped_tool_calls``: those past ``Limits.max_tool_calls_per_turn``, and those after an ``end_turn`` in the
    same reply)."""

    model_calls: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    dropped_tool_calls: int = 0


@dataclass
class Timings:
    """Seconds spent: inside env calls (``env_s``: connecting, or taking a parked session, every step, and closing or
    parking the session, waiting for a free session aside), waiting for the model (``model_s``: every chat request),
    waiting for a free env session (``capacity_wait_s``), and in all (``wall_s``); the event loop's connections are
    opened inside whichever of these first needs them. What ``wall_s`` holds beyond the other three is the loop's own
    work."""

    env_s: float = 0.0
    model_s: float = 0.0
    capacity_wait_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class EpisodeResult:
    """How an episode went: its reward (None unless the env scored it and nothing fatal happened), its flags, the
    chat as the model saw it (tool messages included), each turn's counts, the episode's timings, and how many chat
    requests were sent again after a transient failure (``model_retries``, see ``chat_core.retry``).
    ``env_server`` is the URL of the server that played it (the row's own, or the pool's server it was routed to),
    None when no server started it. ``tool_answers_cut`` counts the tool answers cut to
    ``Limits.max_tool_answer_chars``, and ``tool_answer_bytes_cut`` what was cut of them, in UTF-8 bytes."""

    episode: EpisodeRef
    env_server: str | None = None
    reward: float | None = None
    flags: list[Flag] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnCounts] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    model_retries: int = 0
    tool_answers_cut: int = 0
    tool_answer_bytes_cut: int = 0

    @property
    def scored(self) -> bool:
        """Whether the reward can be trained on: the env gave one and no fatal flag was raised."""
        return self.reward is not None and not any(flag.fatal for flag in self.flags)

    def flag(self, kind: FlagKind, message: str, *, fatal: bool | None = None) -> None:
        """Note that ``kind`` went wrong, as ``message`` says; a fatal flag (by default, one of a kind in ``FATAL``)
        leaves the episode without a reward."""
        flag = Flag(kind, message, fatal)
        self.flags.append(flag)
        if flag.fatal:
            self.reward = None
