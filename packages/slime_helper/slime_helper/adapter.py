"""The rollout process's one slime ``OpenAIAdapter``: the OpenAI chat endpoint an episode's model talks to, which
sends each turn to slime's SGLang router and records it as training tokens.

It is built on the first rollout from slime's launch flags (tokenizer from ``--hf-checkpoint`` through slime's
``load_tokenizer``, parsers from ``--sglang-tool-call-parser`` and ``--sglang-reasoning-parser``, upstream
``http://{--sglang-router-ip}:{--sglang-router-port}``), served on loopback by a thread of its own, and cached on
``AdapterService`` itself rather than through slime's internals; ``AdapterService.reset()`` stops it.

At start the helper probes the tokenizer's chat template: the tool-call parser must read back a call the template
writes (``tool_parser``), and, unless the ``--custom-config-path`` YAML sets ``episode_append_only_chat: false``, each
session is rendered append-only (``renderer``, ``tokenizers``) when probe episodes rendered so match the template's
own render of their chats token for token, but for the differences ``template_match`` allows (``probe_episodes``),
so an episode comes back as one sample; the start log says which rendering the launch uses, and which differences.
The adapter is slime's own class with its hooks extended: each request's session is bound for the rendering, each
recorded turn is held for the session's next one (a turn that fails to be held is kept per session,
``AdapterService.unrecorded_turns``, as is a later turn that couldn't be appended, ``turns_not_appended``), the tool
calls of a reply that slime's adapter doesn't pass on (all but the first) are kept per session
(``AdapterService.dropped_tool_calls``), and a chat the template can't render is answered with a 400 naming the
template's error, kept per session (``AdapterService.template_failure``), instead of slime's 500; and a reply SGLang
aborted reaches the client with finish reason ``abort`` (slime's adapter would say ``stop``), so ``chat_core`` ends
the episode flagged ``reply_aborted``. slime's trajectory manager is built with ``fork_threshold_tokens=0``: a turn
whose prompt doesn't extend the tokens the episode holds then starts a new sample, and is never REALIGNed into the
old one with an earlier reply's training turned off.
"""

from __future__ import annotations

import functools
import logging
from argparse import Namespace
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from aiohttp import web
from chat_core import ChatEndpoint
from chat_core.record.filters import require_filter

from slime_helper._slime import slime
from slime_helper.chat_template import ChatTemplate
from slime_helper.errors import MissingEpisodeNormalization, MissingToolParser, UnappendableChat
from slime_helper.filters import FILTERS
from slime_helper.probe_episodes import proven_tokenizer
from slime_helper.renderer import Unappendable
from slime_helper.rewards import normalizes_per_group
from slime_helper.template_match import ALLOWED_DIFFERENCES
from slime_helper.tokenizers import (
    AppendOnlyTokenizer,
    ChatTemplateFailed,
    TurnNotAppended,
    WholeChatTokenizer,
    turn_session,
)
from slime_helper.tool_parser import check_tool_parser

logger = logging.getLogger(__name__)
APPEND_ONLY_SETTING = "episode_append_only_chat"
"""The ``--custom-config-path`` setting that overrides the rendering the probe picks: ``false`` renders each turn's
whole chat, ``true`` requires the append-only rendering."""


class AdapterService:
    """slime's ``OpenAIAdapter`` for this process, listening on ``chat_url``; ``append_only`` says whether it renders
    each episode append-only, so that an episode comes back as one sample. Raises MissingToolParser when slime
    was launched without ``--sglang-tool-call-parser``, chat_core's MissingFilter when its
    ``--dynamic-sampling-filter-path`` isn't one of this helper's filters, MissingEpisodeNormalization when it
    normalises rewards per prompt group without ``--custom-reward-post-process-path``, UnreadableToolCalls when
    that parser doesn't read the tool calls the model's chat template writes, UnappendableChat when
    ``episode_append_only_chat`` is true and the template can't be rendered append-only, UnsupportedSlime when slime
    lacks what it uses, and ValueError when ``episode_append_only_chat`` isn't true or false."""

    _current: ClassVar[AdapterService | None] = None

    def __init__(self, args: Namespace):
        tool_parser = getattr(args, "sglang_tool_call_parser", None)
        if not tool_parser:
            raise MissingToolParser(
                "slime_helper needs slime's --sglang-tool-call-parser, the SGLang parser that reads the model's "
                "tool calls (e.g. --sglang-tool-call-parser qwen25 for Qwen models); without one every tool call "
                "would reach the env as plain text and every episode would score 0"
            )
        api = slime()
        configured = getattr(args, "dynamic_sampling_filter_path", None)
        require_filter("slime", configured, configured and api.load_function(configured), FILTERS)
        if normalizes_per_group(args) and not getattr(args, "custom_reward_post_process_path", None):
            raise MissingEpisodeNormalization(
                "slime_helper needs slime's --custom-reward-post-process-path slime_helper.rewards."
                f"normalize_per_episode with --advantage-estimator {args.advantage_estimator} and rewards "
                "normalisation on: an episode comes back as several samples, and slime's own normalisation would "
                "then take one group over the whole batch and count a long episode once per sample"
            )
        append_only = getattr(args, APPEND_ONLY_SETTING, None)
        if append_only is not None and not isinstance(append_only, bool):
            raise ValueError(f"{APPEND_ONLY_SETTING} is true or false, not {append_only!r}")
        template = ChatTemplate(
            api.load_tokenizer(args.hf_checkpoint, trust_remote_code=True),
            dict(getattr(args, "apply_chat_template_kwargs", None) or {}),
        )
        reasoning_parser = getattr(args, "sglang_reasoning_parser", None) or None
        check_tool_parser(template, tool_parser, reasoning_parser)
        tokenizer = _tokenizer(template, append_only, Path(args.hf_checkpoint).name)
        self.append_only = isinstance(tokenizer, AppendOnlyTokenizer)
        self.adapter = _episode_adapter(api.OpenAIAdapter)(
            tokenizer=tokenizer,
            sglang_url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
        )
        self._max_context_tokens = int(getattr(args, "rollout_max_context_len", None) or 0)
        self._model = Path(args.hf_checkpoint).name
        # A client that goes away (a cancelled rollout) cancels its handler, which then aborts the SGLang request.
        self._app = api.run_app_in_thread(
            self.adapter.app,
            host="127.0.0.1",
            port=0,
            thread_name="slime-helper-adapter",
            runner_kwargs={"handler_cancellation": True},
        )
        self.chat_url = f"http://127.0.0.1:{self._app.port}/v1/chat/completions"

    @classmethod
    def of(cls, args: Namespace) -> AdapterService:
        """This process's adapter, built from ``args`` on the first call."""
        if cls._current is None:
            cls._current = cls(args)
        return cls._current

    @classmethod
    def reset(cls) -> None:
        """Stop this process's adapter, if there is one; the next ``of`` builds a new one."""
        current, cls._current = cls._current, None
        if current is not None:
            current._app.stop()

    def open_session(self, sid: str, sampling_defaults: Mapping[str, Any]) -> None:
        """Open session ``sid`` on the adapter, whose SGLang requests start from ``sampling_defaults``."""
        self.adapter.open_session(
            sid, sampling_defaults=dict(sampling_defaults), max_context_tokens=self._max_context_tokens
        )

    def chat(self, sid: str) -> ChatEndpoint:
        """The chat endpoint whose requests belong to session ``sid``."""
        return ChatEndpoint(url=self.chat_url, model=self._model, headers={"Authorization": f"Bearer {sid}"})

    def dropped_tool_calls(self, sid: str) -> list[DroppedToolCalls]:
        """The replies of open session ``sid`` so far that made more than one tool call, of which slime's adapter
        passed on only the first."""
        return self.adapter.dropped_tool_calls(sid)

    def template_failure(self, sid: str) -> str | None:
        """The chat template's error on the chat of open session ``sid``, which the adapter answered with a 400;
        None while the template has rendered every turn."""
        return self.adapter.template_failure(sid)

    def turns_not_appended(self, sid: str) -> list[TurnNotAppended]:
        """The later turns of open session ``sid`` whose prompt couldn't be appended to the tokens the turn before
        held, so they were rendered whole (none unless the chat is rendered append-only)."""
        return self.adapter.turns_not_appended(sid)

    def unrecorded_turns(self, sid: str) -> list[str]:
        """Why each turn of open session ``sid`` that the helper failed to hold for the next one wasn't."""
        return self.adapter.unrecorded_turns(sid)


@dataclass(frozen=True)
class DroppedToolCalls:
    """A reply, the session's ``reply``-th, that made the tool calls ``names``: slime's adapter passes on only the
    first and records only that one in the turn's history (``wire_tool_calls[:1]``), so the episode's env never runs
    the others, though the model generated them and slime trains on every token it generated."""

    reply: int
    names: tuple[str, ...]

    @property
    def dropped(self) -> int:
        return len(self.names) - 1

    @property
    def message(self) -> str:
        return (
            f"reply {self.reply} made {len(self.names)} tool calls ({', '.join(self.names)}); slime's adapter passed "
            f"on only the first, so the env never ran the other {self.dropped}, though they are trained on"
        )


@dataclass
class _SessionReplies:
    replies: int = 0
    dropped: list[DroppedToolCalls] = field(default_factory=list)
    template_failure: str | None = None
    unrecorded: list[str] = field(default_factory=list)


def _tokenizer(template: ChatTemplate, append_only: bool | None, model: str) -> WholeChatTokenizer:
    """The tokenizer the adapter renders with: append-only unless ``append_only`` is False or the template can't be
    rendered append-only, which is refused when ``append_only`` is True and said loudly otherwise."""
    arguments = " (tool-call arguments as JSON text, the form it takes)" if template.string_arguments else ""
    if append_only is False:
        logger.info(
            "[slime_helper] chat rendering: each turn's whole chat, with the chat template of %s%s, as %s: false "
            "asks; an episode comes back as several samples wherever the template renders earlier turns otherwise "
            "than the model saw them (rollout/episode/samples_per_episode)",
            model,
            arguments,
            APPEND_ONLY_SETTING,
        )
        return WholeChatTokenizer(template)
    try:
        tokenizer, differences = proven_tokenizer(template)
    except Unappendable as why:
        if append_only:
            raise UnappendableChat(
                f"{APPEND_ONLY_SETTING} is true, but the chat template of {model} can't be rendered append-only: {why}"
            ) from None
        logger.warning(
            "[slime_helper] THE CHAT TEMPLATE OF %s CAN'T BE RENDERED APPEND-ONLY: %s. Each turn's whole chat is "
            "rendered with it instead, so an episode comes back as several samples wherever the template renders "
            "earlier turns otherwise than the model saw them; rollout/episode/samples_per_episode counts them",
            model,
            why,
        )
        return WholeChatTokenizer(template)
    named = "; ".join(f"{each.name} ({each.reason})" for each in ALLOWED_DIFFERENCES if each in differences)
    logger.info(
        "[slime_helper] chat rendering: append-only, from the chat template of %s%s: each turn is the tokens the "
        "last turn held, the reply as sampled, then what the turn adds as the template renders it, so an episode is "
        "one sample (%s: false renders each turn's whole chat instead). Probe episodes match the template's own "
        "render of their whole chats token for token%s",
        model,
        arguments,
        APPEND_ONLY_SETTING,
        f", but for these differences: {named}" if named else "",
    )
    return tokenizer


@functools.cache
def _episode_adapter(openai_adapter: type) -> type:
    """slime's ``openai_adapter`` class, its hooks extended for the helper."""

    class EpisodeAdapter(openai_adapter):
        """slime's ``OpenAIAdapter``, which also binds each request's session while the request is served
        (``tokenizers.turn_session``), hands each turn it records to an ``AppendOnlyTokenizer`` (through the
        adapter's ``debug_callback``, slime's one hook that sees a recorded turn's tokens), gives the turn it
        records the reply's reasoning as the client gets it back, keeps each open session's
        ``dropped_tool_calls`` and ``unrecorded_turns``, and answers a chat its template can't render with a 400
        naming the template's error, kept as the session's ``template_failure``, and tells the client when SGLang
        aborted the reply. Its trajectory manager forks rather than REALIGNs (``fork_threshold_tokens=0``: slime
        REALIGNs a turn whose prompt parts from the held tokens inside the last reply, when that reply is shorter than
        the threshold, and turns the reply's training off)."""

        def __init__(self, *, tokenizer: Any, **kwargs: Any):
            self._appended = tokenizer if isinstance(tokenizer, AppendOnlyTokenizer) else None
            recorded = self._held_for_next_turn if self._appended is not None else None
            super().__init__(tokenizer=tokenizer, fork_threshold_tokens=0, debug_callback=recorded, **kwargs)
            self._replies: dict[str, _SessionReplies] = {}
            self.app.middlewares.append(self._answer_template_failures)

        def _held_for_next_turn(self, sid: str, *recorded: Any) -> None:
            """The turn slime records for session ``sid``, held by the append-only tokenizer; slime only logs what
            its ``debug_callback`` raises, so a failure is also kept for the session's episode to be flagged."""
            if self._appended is None:
                return
            try:
                self._appended.record(sid, *recorded)
            except Exception as failed:
                if (replies := self._replies.get(sid)) is not None:
                    replies.unrecorded.append(
                        f"model call {replies.replies}'s turn couldn't be held for the next one "
                        f"({type(failed).__name__}: {failed}), so the next turn is rendered whole"
                    )
                raise

        @web.middleware
        async def _answer_template_failures(self, request: web.Request, handler: Any) -> web.StreamResponse:
            try:
                return await handler(request)
            except ChatTemplateFailed as failed:
                if (replies := self._replies.get(failed.session or "")) is not None:
                    replies.template_failure = failed.message
                error = {"message": str(failed), "type": "invalid_request_error", "code": "chat_template_failed"}
                return web.json_response({"error": error}, status=400)

        def dropped_tool_calls(self, sid: str) -> list[DroppedToolCalls]:
            replies = self._replies.get(sid)
            return list(replies.dropped) if replies is not None else []

        def template_failure(self, sid: str) -> str | None:
            replies = self._replies.get(sid)
            return replies.template_failure if replies is not None else None

        def turns_not_appended(self, sid: str) -> list[TurnNotAppended]:
            return self._appended.turns_not_appended(sid) if self._appended is not None else []

        def unrecorded_turns(self, sid: str) -> list[str]:
            replies = self._replies.get(sid)
            return list(replies.unrecorded) if replies is not None else []

        def open_session(self, sid: str, **kwargs: Any) -> None:
            super().open_session(sid, **kwargs)
            self._replies[sid] = _SessionReplies()
            if self._appended is not None:
                self._appended.open(sid)

        async def finish_session(self, sid: str, **kwargs: Any) -> list:
            try:
                return await super().finish_session(sid, **kwargs)
            finally:
                self._forget(sid)

        async def drop_session(self, sid: str, **kwargs: Any) -> None:
            try:
                await super().drop_session(sid, **kwargs)
            finally:
                self._forget(sid)

        def _forget(self, sid: str) -> None:
            self._replies.pop(sid, None)
            if self._appended is not None:
                self._appended.forget(sid)

        def _session_id(self, request: Any, body: dict) -> str:
            sid = super()._session_id(request, body)
            turn_session.set(sid)
            return sid

        def _build_reply(self, parsed: Any, raw_finish: str, translated: list, tools_schema: Any) -> Any:
            reply = super()._build_reply(parsed, raw_finish, translated, tools_schema)
            # The client sends the reply back with the reasoning slime gave it; slime records the turn without it,
            # and a turn that doesn't equal the reply sent back makes slime fork the episode there, or stop training
            # the turn.
            if parsed.reasoning:
                reply.manager_message["reasoning_content"] = parsed.reasoning
            # slime's adapter answers a generation SGLang aborted (its engines paused for a weight update, or any
            # abort) with finish reason stop, so the episode would play on from the cut reply as if it were whole.
            if raw_finish == "abort":
                reply.wire = (reply.wire[0], "abort")
            if (replies := self._replies.get(turn_session.get())) is not None:
                replies.replies += 1
                if len(parsed.tool_uses) > 1:
                    names = tuple(str(call.get("name", "tool")) for call in parsed.tool_uses)
                    replies.dropped.append(DroppedToolCalls(replies.replies, names))
            return reply

    return EpisodeAdapter
