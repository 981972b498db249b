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
    - ``reply_truncated``: a reply stopped at the model's token limit (finish reason ``length``); it was played as
      it came, so the reward may be for a cut answer or a cut tool call.
    - ``tool_calls_dropped``: a reply made several tool calls and the trainer's chat endpoint passed on only some
      of them, so the env never ran the others, though the model is trained on them (a helper's flag: ``play``
      sees only the calls passed on).
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
      answers when the trainer pauses or aborts its engines, e.g. to update weights); the episode ends there rather
      than play on from a cut reply.
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
      endpoint's refusal raised)."""

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
    TURN_NOT_APPENDED = "turn_not_appended"
    TURN_NOT_RECORDED = "turn_not_recorded"


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
    """Something that went wrong in an episode, with what a person needs to find it."""

    kind: FlagKind
    message: str

    @property
    def fatal(self) -> bool:
        return self.kind in FATAL

    def as_dict(self) -> dict[str, Any]:
        """The flag as plain JSON data, the shape trainers keep in a sample's metadata."""
        return {"kind": str(self.kind), "message": self.message, "fatal": self.fatal}


@dataclass
class TurnCounts:
    """One env turn: the model's replies, the tool calls answered (``end_turn`` aside) and how many of them were
    errors (the env's, or arguments refused before reaching it)."""

    model_calls: int = 0
    tool_calls: int = 0
    tool_errors: int = 0


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
    None when no server started it."""

    episode: EpisodeRef
    env_server: str | None = None
    reward: float | None = None
    flags: list[Flag] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnCounts] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    model_retries: int = 0

    @property
    def scored(self) -> bool:
        """Whether the reward can be trained on: the env gave one and no fatal flag was raised."""
        return self.reward is not None and not any(flag.fatal for flag in self.flags)

    def flag(self, kind: FlagKind, message: str) -> None:
        """Note that ``kind`` went wrong, as ``message`` says; a fatal kind leaves the episode without a reward."""
        flag = Flag(kind, message)
        self.flags.append(flag)
        if flag.fatal:
            self.reward = None
