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
``AdapterService.unrecorded_turns``, as is a later turn that couldn't be appended, ``turns_not_appended``), and every
tool call of a reply is passed on and recorded (slime's adapter passes on the first only, so the env would never run
the others, though the model is trained on them). A chat the template can't render is answered with a 400 naming
the template's error, kept per session (``AdapterService.template_failure``), instead of slime's 500; a prompt that
fills ``--rollout-max-context-len`` with OpenAI's 400 ``context_length_exceeded``, recording nothing, where slime's
adapter would record an empty reply cut at ``length``, so ``chat_core`` cuts the episode short flagged
``context_exhausted``. A reply SGLang aborted or cut at its token limit reaches the client with finish reason
``abort`` or ``length`` (slime's adapter says ``stop`` for the first and ``tool_calls`` for a cut reply holding a
call), so ``chat_core`` ends the episode flagged ``reply_aborted`` or ``response_limit``, unless a weight update cut
it: then the client is asked to send the chat again and the reply goes on from the cut (``resume``). slime's
trajectory manager is built with ``fork_threshold_tokens=0``: a turn whose prompt doesn't extend the tokens the
episode holds then starts a new sample, and is never REALIGNed into the old one with an earlier reply's training
turned off.

The episodes the rollout process plays itself reach the adapter without HTTP: their chat endpoint hands each request
to the adapter's handler of ``/v1/chat/completions`` on the episode's own event loop (``answer_in_process``), which
saves the loopback request's CPU on both ends. The served endpoint answers anyone else, without an access-log line
per request. The objects built at start are frozen out of the garbage collector's reach (``gc.freeze``), so its
full collections, which a rollout of many episodes triggers, don't walk the tokenizer's and slime's start-up heap,
and young collections run less often (``YOUNG_COLLECTION_ALLOCATIONS``).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import secrets
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from aiohttp import web
from chat_core import ChatEndpoint, parse_json
from chat_core.net.http_request import Answer
from chat_core.record.filters import require_filter
from multidict import CIMultiDict, CIMultiDictProxy

from slime_helper._slime import slime
from slime_helper.chat_template import ChatTemplate
from slime_helper.errors import MissingEpisodeNormalization, MissingToolParser, PartialRolloutRefused, UnappendableChat
from slime_helper.filters import FILTERS
from slime_helper.probe_episodes import proven_tokenizer
from slime_helper.renderer import Unappendable
from slime_helper.resume import (
    ASK_AGAIN,
    Resumed,
    ResumePolicy,
    Resumes,
    ResumingTokenizer,
    ask_again_answer,
    resuming_manager,
)
from slime_helper.rewards import normalizes_per_group
from slime_helper.template_match import ALLOWED_DIFFERENCES
from slime_helper.tokenizers import (
    AppendOnlyTokenizer,
    ChatTemplateFailed,
    ContextFull,
    TurnNotAppended,
    WholeChatTokenizer,
    turn_session,
)
from slime_helper.tool_parser import check_tool_parser

logger = logging.getLogger(__name__)
YOUNG_COLLECTION_ALLOCATIONS = 10_000
"""The garbage collector's first threshold in the rollout process (CPython's default is 700): a model turn allocates
thousands of objects that live only until its reply is answered, and a young collection that finds them alive
promotes them towards the oldest generation, whose full collections then walk every episode in flight. Collecting
less often lets most of them die first; it holds at most this many more objects uncollected."""
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
    lacks what it uses, PartialRolloutRefused with ``--partial-rollout``, and ValueError when
    ``episode_append_only_chat`` isn't true or false."""

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
        if getattr(args, "partial_rollout", False):
            raise PartialRolloutRefused(
                "slime_helper can't take --partial-rollout: an episode plays in an env session that ends with its "
                "rollout, so a partial sample can't go on in a later one (and slime's abort() reads sample.response "
                "of each episode, which slime_helper returns as a list of samples). Leave it out: under "
                "train_async.py with --rollout-function-path slime_helper.generate_rollout_fully_async, a model "
                "call that a weight update cuts goes on from where it was cut, in the same env session"
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
        self._max_context_tokens = int(getattr(args, "rollout_max_context_len", None) or 0)
        tokenizer = _tokenizer(template, append_only, Path(args.hf_checkpoint).name, self._max_context_tokens)
        self.append_only = isinstance(tokenizer, AppendOnlyTokenizer)
        self.adapter = _episode_adapter(api.OpenAIAdapter)(
            tokenizer=tokenizer,
            sglang_url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
        )
        self._model = Path(args.hf_checkpoint).name
        # A client that goes away (a cancelled rollout) cancels its handler, which then aborts the SGLang request.
        self._app = api.run_app_in_thread(
            self.adapter.app,
            host="127.0.0.1",
            port=0,
            thread_name="slime-helper-adapter",
            runner_kwargs={"handler_cancellation": True, "access_log": None},
        )
        self.chat_url = f"http://127.0.0.1:{self._app.port}/v1/chat/completions"
        gc.collect()
        gc.freeze()
        gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, *gc.get_threshold()[1:])

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

    def open_session(self, sid: str, sampling_defaults: Mapping[str, Any], resume: ResumePolicy | None = None) -> None:
        """Open session ``sid`` on the adapter, whose SGLang requests start from ``sampling_defaults`` and whose model
        calls a weight update cuts are asked again as ``resume`` says (without one, a cut reply reaches the client as
        an abort)."""
        self.adapter.open_session(
            sid, sampling_defaults=dict(sampling_defaults), max_context_tokens=self._max_context_tokens, resume=resume
        )

    def chat(self, sid: str) -> ChatEndpoint:
        """The chat endpoint whose requests belong to session ``sid``, answered in this process."""
        return ChatEndpoint(
            url=self.chat_url,
            model=self._model,
            headers={"Authorization": f"Bearer {sid}"},
            in_process=self.adapter.answer_in_process,
        )

    def template_failure(self, sid: str) -> str | None:
        """The chat template's error on the chat of open session ``sid``, which the adapter answered with a 400;
        None while the template has rendered every turn."""
        return self.adapter.template_failure(sid)

    def resumed(self, sid: str) -> Resumed:
        """What weight updates did to open session ``sid``'s model calls so far."""
        return self.adapter.resumes.of(sid)

    def turns_not_appended(self, sid: str) -> list[TurnNotAppended]:
        """The later turns of open session ``sid`` whose prompt couldn't be appended to the tokens the turn before
        held, so they were rendered whole (none unless the chat is rendered append-only)."""
        return self.adapter.turns_not_appended(sid)

    def unrecorded_turns(self, sid: str) -> list[str]:
        """Why each turn of open session ``sid`` that the helper failed to hold for the next one wasn't."""
        return self.adapter.unrecorded_turns(sid)


@dataclass
class _SessionNotes:
    """What the adapter keeps of an open session for its episode's record: the replies answered so far, the
    template's error on its chat, and why each turn the helper failed to hold wasn't."""

    replies: int = 0
    template_failure: str | None = None
    unrecorded: list[str] = field(default_factory=list)


def _tokenizer(
    template: ChatTemplate, append_only: bool | None, model: str, max_context_tokens: int
) -> WholeChatTokenizer:
    """The tokenizer the adapter renders with, refusing a prompt of ``max_context_tokens`` or more: append-only unless
    ``append_only`` is False or the template can't be rendered append-only, which is refused when ``append_only`` is
    True and said loudly otherwise."""
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
        return WholeChatTokenizer(template, max_context_tokens)
    try:
        tokenizer, differences = proven_tokenizer(template, max_context_tokens)
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
        return WholeChatTokenizer(template, max_context_tokens)
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
        records the reply's reasoning as the client gets it back and every tool call of the reply, keeps each open
        session's ``unrecorded_turns``, answers a chat its template can't render with a 400 naming the template's
        error, kept as the session's ``template_failure``, and a prompt that fills the context with OpenAI's 400, and
        tells the client when SGLang aborted or cut the reply. A reply a weight update cut is answered with a 503
        instead, and the chat sent again goes on from the cut (``resumes``, with slime's ``TrajectoryManager``
        subclassed to record the cut and the rest as one turn). Its trajectory manager forks rather than REALIGNs
        (``fork_threshold_tokens=0``: slime REALIGNs a turn whose prompt parts from the held tokens inside the last
        reply, when that reply is shorter than the threshold, and turns the reply's training off)."""

        def __init__(self, *, tokenizer: Any, **kwargs: Any):
            self._appended = tokenizer if isinstance(tokenizer, AppendOnlyTokenizer) else None
            recorded = self._held_for_next_turn if self._appended is not None else None
            self.resumes = Resumes()
            super().__init__(
                tokenizer=ResumingTokenizer(tokenizer, self.resumes),
                fork_threshold_tokens=0,
                debug_callback=recorded,
                **kwargs,
            )
            self.manager = resuming_manager(self.resumes, fork_threshold_tokens=0)
            self._sessions: dict[str, _SessionNotes] = {}
            self.app.middlewares.append(self._answer_refused_turns)

        def _held_for_next_turn(self, sid: str, *recorded: Any) -> None:
            """The turn slime records for session ``sid``, held by the append-only tokenizer; slime only logs what
            its ``debug_callback`` raises, so a failure is also kept for the session's episode to be flagged."""
            if self._appended is None:
                return
            try:
                self._appended.record(sid, *recorded)
            except Exception as failed:
                if (notes := self._sessions.get(sid)) is not None:
                    notes.unrecorded.append(
                        f"model call {notes.replies}'s turn couldn't be held for the next one "
                        f"({type(failed).__name__}: {failed}), so the next turn is rendered whole"
                    )
                raise

        @web.middleware
        async def _answer_refused_turns(self, request: web.Request, handler: Any) -> web.StreamResponse:
            try:
                return await handler(request)
            except ChatTemplateFailed as failed:
                if (notes := self._sessions.get(failed.session or "")) is not None:
                    notes.template_failure = failed.message
                return _refusal(str(failed), "chat_template_failed")
            except ContextFull as full:
                return _refusal(str(full), "context_length_exceeded")

        async def answer_in_process(self, body: bytes, headers: Mapping[str, str]) -> Answer:
            """The answer the adapter's ``/v1/chat/completions`` would send to a request of ``body`` and ``headers``,
            made by the same handler and middleware on the caller's event loop. A request aiohttp's server would
            answer with an error status (an HTTP exception the handler raises, or any other exception: a 500, logged)
            is answered the same way."""
            request = _InProcessRequest(body, CIMultiDictProxy(CIMultiDict(headers)))
            try:
                response = await self._answer_refused_turns(request, self._run_turn)
            except web.HTTPException as refused:
                response = refused
            except Exception:
                logger.exception("[slime_helper] the adapter failed to answer a chat request")
                response = web.HTTPInternalServerError()
            finally:
                turn_session.set(None)
            return Answer(response.status, response.headers, response.body or b"")

        def template_failure(self, sid: str) -> str | None:
            notes = self._sessions.get(sid)
            return notes.template_failure if notes is not None else None

        def turns_not_appended(self, sid: str) -> list[TurnNotAppended]:
            return self._appended.turns_not_appended(sid) if self._appended is not None else []

        def unrecorded_turns(self, sid: str) -> list[str]:
            notes = self._sessions.get(sid)
            return list(notes.unrecorded) if notes is not None else []

        def open_session(self, sid: str, *, resume: ResumePolicy | None = None, **kwargs: Any) -> None:
            super().open_session(sid, **kwargs)
            self._sessions[sid] = _SessionNotes()
            if resume is not None:
                self.resumes.open(sid, resume, (kwargs.get("sampling_defaults") or {}).get("max_new_tokens"))
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
            self._sessions.pop(sid, None)
            self.resumes.forget(sid)
            if self._appended is not None:
                self._appended.forget(sid)

        def _session_id(self, request: Any, body: dict) -> str:
            sid = super()._session_id(request, body)
            turn_session.set(sid)
            self.resumes.shorten(sid, body, self.max_token_keys)
            return sid

        def _build_reply(self, parsed: Any, raw_finish: str, translated: list, tools_schema: Any) -> Any:
            reply = super()._build_reply(parsed, raw_finish, translated, tools_schema)
            # The client sends the reply back with the reasoning slime gave it; slime records the turn without it,
            # and a turn that doesn't equal the reply sent back makes slime fork the episode there, or stop training
            # the turn.
            if parsed.reasoning:
                reply.manager_message["reasoning_content"] = parsed.reasoning
            # slime's adapter passes on and records only a reply's first tool call (some clients drop the others
            # when they send the reply back); chat_core sends back every one, so the recorded turn holds them all.
            if len(parsed.tool_uses) > 1:
                reply.wire[0]["tool_calls"], reply.manager_message["tool_calls"] = _every_call(parsed.tool_uses)
            # A generation a weight update cut is asked again (resume). slime's adapter answers any other abort with
            # finish reason stop, and one cut at its token limit holding a call with tool_calls, so the episode would
            # play on from the cut reply as if it were whole.
            if raw_finish == "abort" and self.resumes.asks_again(turn_session.get()):
                reply.wire = ASK_AGAIN
                return reply
            if raw_finish in ("abort", "length"):
                reply.wire = (reply.wire[0], raw_finish)
            if (notes := self._sessions.get(turn_session.get() or "")) is not None:
                notes.replies += 1
            return reply

        async def _respond(self, request: Any, body: dict, reply: Any, *args: Any) -> web.StreamResponse:
            if reply.wire is ASK_AGAIN:
                sid = turn_session.get() or ""
                return ask_again_answer(sid, self.resumes.of(sid))
            return await super()._respond(request, body, reply, *args)

        def _run_debug_callback(self, sid: str, *args: Any) -> None:
            # The turn a weight update cut is not held: the chat sent again renders as the one before it.
            if not self.resumes.cutting(sid):
                super()._run_debug_callback(sid, *args)

    return EpisodeAdapter


@dataclass(frozen=True)
class _InProcessRequest:
    """What slime's adapter reads of a chat request (its headers and its JSON body), for a request handed to it in
    this process."""

    body: bytes
    headers: CIMultiDictProxy[str]

    async def json(self) -> Any:
        """The body as aiohttp's ``Request.json`` reads it with Python's ``json`` (integers past 64 bits as
        written), by chat_core's parser, which takes orjson wherever it reads the same values."""
        return parse_json(self.body)


def _every_call(tool_uses: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The tool calls slime's parser read in a reply, as OpenAI's wire gives them to the client (each with an id
    and its arguments as JSON text) and as slime's adapter records them (arguments as an object, no id), in the
    shapes slime's adapter gives its first one, so the reply the client sends back matches the recorded turn."""
    wire, recorded = [], []
    for use in tool_uses:
        name = use.get("name", "tool")
        arguments = use.get("input") or {}
        if not isinstance(arguments, dict):
            arguments = {"_raw_arguments": str(arguments)}
        text = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
        call = {"name": name, "arguments": text}
        wire.append({"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": call})
        recorded.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return wire, recorded


def _refusal(message: str, code: str) -> web.Response:
    """An OpenAI 400 answering a turn the adapter can't send to the model."""
    error = {"message": message, "type": "invalid_request_error", "code": code}
    return web.json_response({"error": error}, status=400)
