"""The rollout process's one slime ``OpenAIAdapter``: the OpenAI chat endpoint an episode's model talks to, which
sends each turn to slime's SGLang router and records it as training tokens.

It is built on the first rollout from slime's launch flags (tokenizer from ``--hf-checkpoint`` through slime's
``load_tokenizer``, parsers from ``--sglang-tool-call-parser`` and ``--sglang-reasoning-parser``, upstream
``http://{--sglang-router-ip}:{--sglang-router-port}``), served on loopback by a thread of its own, and cached on
``AdapterService`` itself rather than through slime's internals; ``AdapterService.reset()`` stops it.

When the tokenizer's chat template is Qwen3's, the adapter renders each session append-only
(``append_only.AppendOnlyTokenizer``), so an episode comes back as one sample, unless the ``--custom-config-path``
YAML sets ``episode_append_only_chat: false``. The adapter is slime's own class with its hooks extended: each
request's session is bound for the rendering, each recorded turn is held for the session's next one, and the tool
calls of a reply that slime's adapter doesn't pass on (all but the first) are kept per session
(``AdapterService.dropped_tool_calls``).
"""

from __future__ import annotations

import functools
import logging
from argparse import Namespace
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from chat_core import ChatEndpoint
from chat_core.record.filters import require_filter

from slime_helper._slime import slime
from slime_helper.append_only import AppendOnlyTokenizer, turn_session
from slime_helper.errors import MissingEpisodeNormalization, MissingToolParser
from slime_helper.filters import FILTERS
from slime_helper.qwen3_chat import Qwen3Chat
from slime_helper.rewards import normalizes_per_group

logger = logging.getLogger(__name__)
APPEND_ONLY_SETTING = "episode_append_only_chat"
"""The ``--custom-config-path`` setting that turns the append-only rendering off (``false``); it is on by default."""


class AdapterService:
    """slime's ``OpenAIAdapter`` for this process, listening on ``chat_url``. Raises MissingToolParser when slime
    was launched without ``--sglang-tool-call-parser``, chat_core's MissingFilter when its
    ``--dynamic-sampling-filter-path`` isn't one of this helper's filters, MissingEpisodeNormalization when it
    normalises rewards per prompt group without ``--custom-reward-post-process-path``, UnsupportedSlime when
    slime lacks what it uses, and ValueError when ``episode_append_only_chat`` isn't true or false."""

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
        append_only = getattr(args, APPEND_ONLY_SETTING, True)
        if not isinstance(append_only, bool):
            raise ValueError(f"{APPEND_ONLY_SETTING} is true or false, not {append_only!r}")
        tokenizer = _tokenizer(
            api.load_tokenizer(args.hf_checkpoint, trust_remote_code=True),
            dict(getattr(args, "apply_chat_template_kwargs", None) or {}),
            append_only,
        )
        self.adapter = _episode_adapter(api.OpenAIAdapter)(
            tokenizer=tokenizer,
            sglang_url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
            tool_parser=tool_parser,
            reasoning_parser=getattr(args, "sglang_reasoning_parser", None) or None,
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


def _tokenizer(tokenizer: Any, template_kwargs: dict[str, Any], append_only: bool) -> Any:
    """The tokenizer the adapter renders with: append-only when ``append_only`` and its template is Qwen3's,
    otherwise its own template with ``template_kwargs``."""
    chat = Qwen3Chat.of(tokenizer, template_kwargs) if append_only else None
    if chat is not None:
        logger.info("[slime_helper] rendering each episode's chat append-only in Qwen3's layout, think blocks kept")
        return AppendOnlyTokenizer(tokenizer, chat)
    if append_only:
        logger.warning(
            "[slime_helper] the chat template of --hf-checkpoint isn't recognised as Qwen3's, so the adapter renders "
            "each turn with it as it is, and an episode may come back as several samples "
            "(rollout/episode/samples_per_episode says how many)"
        )
    return TemplateKwargsTokenizer(tokenizer, template_kwargs) if template_kwargs else tokenizer


@functools.cache
def _episode_adapter(openai_adapter: type) -> type:
    """slime's ``openai_adapter`` class, its hooks extended for the helper."""

    class EpisodeAdapter(openai_adapter):
        """slime's ``OpenAIAdapter``, which also binds each request's session while the request is served
        (``append_only.turn_session``), hands each turn it records to an ``AppendOnlyTokenizer`` (through the
        adapter's ``debug_callback``, slime's one hook that sees a recorded turn's tokens), gives the turn it
        records the reply's reasoning as the client gets it back, and keeps each open session's
        ``dropped_tool_calls``."""

        def __init__(self, *, tokenizer: Any, **kwargs: Any):
            self._appended = tokenizer if isinstance(tokenizer, AppendOnlyTokenizer) else None
            recorded = self._appended.record if self._appended is not None else None
            super().__init__(tokenizer=tokenizer, debug_callback=recorded, **kwargs)
            self._replies: dict[str, _SessionReplies] = {}

        def dropped_tool_calls(self, sid: str) -> list[DroppedToolCalls]:
            replies = self._replies.get(sid)
            return list(replies.dropped) if replies is not None else []

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
            if (replies := self._replies.get(turn_session.get())) is not None:
                replies.replies += 1
                if len(parsed.tool_uses) > 1:
                    names = tuple(str(call.get("name", "tool")) for call in parsed.tool_uses)
                    replies.dropped.append(DroppedToolCalls(replies.replies, names))
            return reply

    return EpisodeAdapter


class TemplateKwargsTokenizer:
    """A tokenizer whose ``apply_chat_template`` always gets ``template_kwargs`` (e.g. ``enable_thinking=False``),
    since slime's adapter renders every session's chat with the tokenizer's defaults. Everything else is the wrapped
    tokenizer's."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any]):
        self._tokenizer = tokenizer
        self._template_kwargs = dict(template_kwargs)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(conversation, **{**self._template_kwargs, **kwargs})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
