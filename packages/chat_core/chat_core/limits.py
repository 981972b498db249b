"""How a launch plays each episode: the episode's bounds and the most it reads of one answer. Plain data, checked
when made, so a launch with a bound out of range stops before any episode."""

from __future__ import annotations

from dataclasses import dataclass

from chat_core._wire import MIB


@dataclass(frozen=True)
class Limits:
    """How the launch plays each episode. ``max_turns``: env turns played; one more ends it unscored.
    ``max_tool_calls_per_turn``: tool calls the model makes in a turn; one more ends the turn with the model's latest
    text. ``model_deadline_s``: seconds the episode may spend waiting for the model, all calls together.
    ``capacity_wait_s``: seconds to wait for a free env session while the server (every server of the pool) is full.
    ``env_call_deadline_s``: seconds one env call may go unanswered (reset, list_tools, a tool call, end_turn with the
    verifiers it runs), so a stuck env can't hold an episode.

    ``max_chat_answer_bytes``: the longest chat completion read, counted after any content coding is undone (a
    32,768-token reply is about 150 KB); a longer one fails the episode's chat as it arrives. ``max_env_message_bytes``:
    the longest message of an env session, and so its longest frame (a tool's observation of several MB fits); a
    longer one ends the session, refused by its announced length before its payload is read.

    ``max_tool_answer_chars``: the longest tool answer the model is shown, in characters; a longer one is cut there
    and ends with a line saying how much more the tool answered. The default, about 4,000 tokens of text, is an
    eighth of a 32K context.

    An episode is cut short when its next prompt doesn't fit the model's context (the chat endpoint refuses it as
    too long, or ``max_context_tokens`` is reached: the tokens of the context, prompt and reply, for a chat endpoint
    that doesn't bound them itself, as Miles' session server doesn't bound its ``--max-seq-len``), and, unless
    ``play_on_cut_reply``, when a reply stops at the model's token limit. ``score_cut_short``: such an episode's
    turn is handed to the env with the latest reply's text and scored as it stands; otherwise (the default) it ends
    unscored, without running the env's verifiers, so the trainer's filter leaves its group out, as DAPO's overlong
    filtering leaves out a reply cut at the length limit. Raises ValueError when a bound is out of range or a switch
    isn't a bool."""

    max_turns: int = 16
    max_tool_calls_per_turn: int = 32
    model_deadline_s: float = 900.0
    capacity_wait_s: float = 600.0
    env_call_deadline_s: float = 600.0
    max_chat_answer_bytes: int = 32 * MIB
    max_env_message_bytes: int = 32 * MIB
    max_tool_answer_chars: int = 16_000
    max_context_tokens: int | None = None
    play_on_cut_reply: bool = False
    score_cut_short: bool = False

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tool_calls_per_turn < 1:
            raise ValueError(f"{self}: max_turns and max_tool_calls_per_turn must be at least 1")
        if not self.model_deadline_s > 0 or not self.env_call_deadline_s > 0 or not self.capacity_wait_s >= 0:
            raise ValueError(
                f"{self}: model_deadline_s and env_call_deadline_s must be positive and capacity_wait_s not negative"
            )
        if self.max_chat_answer_bytes < 1 or self.max_env_message_bytes < 1 or self.max_tool_answer_chars < 1:
            raise ValueError(
                f"{self}: max_chat_answer_bytes, max_env_message_bytes and max_tool_answer_chars must be at least 1"
            )
        if self.max_context_tokens is not None and self.max_context_tokens < 1:
            raise ValueError(f"{self}: max_context_tokens must be at least 1, or None")
        if not isinstance(self.play_on_cut_reply, bool) or not isinstance(self.score_cut_short, bool):
            raise ValueError(f"{self}: play_on_cut_reply and score_cut_short are true or false")
