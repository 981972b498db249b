"""A model call that a weight update cut, asked again so that the episode plays on in the same env session.

slime's fully-async training updates the weights while episodes play, pausing SGLang in its default ``abort`` mode:
every ``/generate`` in flight answers at once with the tokens generated so far and finish reason ``abort``, and new
requests wait until the engines continue. For a session the helper opened, while slime's rollout isn't over, the
adapter answers such a cut call with a 503 instead of a reply, so chat_core sends the same chat again; meanwhile the
session holds the cut (``Cut``: the prompt's tokens, and the tokens and logprobs generated so far), which neither the
tokenizer nor slime's ``TrajectoryManager`` records. The chat sent again is rendered to the same prompt, and
SGLang is asked for the rest of the reply: the prompt, then the cut tokens (``ResumingTokenizer``), with the
response budget less what was cut (``Resumes.shorten``). SGLang holds that request until the engines continue with
the new weights. The reply the client gets is parsed from the whole text (``ResumingTokenizer.decode``), and the
manager records one turn: the prompt, then the cut tokens and the rest, each with the logprob it was sampled with
(``resuming_manager``). A reply cut again goes on from all it has so far.

An abort while slime's rollout is over (slime's standard rollout sets ``GenerateState.aborted`` before it aborts
what still plays once its batch is full) reaches the client as an abort, and so does a cut past the session's
``episode_max_resumed_calls``: the episode then ends there (``Resumed.limit`` says why).
"""

from __future__ import annotations

import functools
import logging
from argparse import Namespace
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from slime_helper._slime import slime
from slime_helper.tokenizers import turn_session

logger = logging.getLogger(__name__)

MAX_RESUMED_CALLS_SETTING = "episode_max_resumed_calls"
"""The ``--custom-config-path`` setting bounding how many of an episode's model calls a weight update may cut and
have asked again; the next cut ends the episode flagged ``resume_limit``."""
DEFAULT_MAX_RESUMED_CALLS = 4
"""Four weight updates reaching one episode's model calls: Miles' and slime's fully-async rollouts set no bound by
default, and the bounds their users are shown are of that size (Miles' multi-LoRA example trains with
``--max-weight-staleness 3``, AReaL's example with ``max_head_offpolicyness=4``)."""

ASK_AGAIN = object()
"""The ``wire`` of a reply the adapter doesn't send: a weight update cut it, and the client is to ask again."""


def max_resumed_calls(args: Namespace) -> int:
    """The launch's ``episode_max_resumed_calls``: the default unless ``--custom-config-path`` sets it. Raises
    ValueError when it isn't a whole number of calls, 0 or more."""
    value = getattr(args, MAX_RESUMED_CALLS_SETTING, None)
    if value is None:
        return DEFAULT_MAX_RESUMED_CALLS
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{MAX_RESUMED_CALLS_SETTING} is a number of model calls, 0 or more, not {value!r}")
    return value


@dataclass(frozen=True)
class ResumePolicy:
    """How a session's cut model calls are handled: asked again up to ``max_calls`` of them, unless
    ``rollout_over()`` says the trainer's rollout is over."""

    max_calls: int
    rollout_over: Callable[[], bool]


@dataclass(frozen=True)
class Cut:
    """A model call a weight update cut: its prompt's tokens, and the tokens generated so far with their
    logprobs."""

    prompt_ids: list[int]
    output_ids: list[int]
    log_probs: list[float]


_resuming: ContextVar[Cut | None] = ContextVar("slime_helper_resuming", default=None)
"""The cut that the request being served asks SGLang to go on from, in that request's task."""


@dataclass(frozen=True)
class Resumed:
    """What weight updates did to a session's model calls: ``calls`` asked again after a cut, ``cut_tokens`` they had
    generated when cut (kept: the replies went on from them), and ``limit``, why the episode ended at a cut past
    ``episode_max_resumed_calls`` (None unless it did)."""

    calls: int = 0
    cut_tokens: int = 0
    limit: str | None = None


@dataclass
class _Session:
    policy: ResumePolicy
    budget: int | None
    calls: int = 0
    cut_tokens: int = 0
    limit: str | None = None
    cutting: bool = False
    held: Cut | None = None


class Resumes:
    """The adapter's open sessions whose cut model calls are asked again. The adapter calls ``asks_again`` on a
    reply SGLang aborted, then the manager ``recorded`` with the turn; the next request of the session is
    ``shorten``-ed and rendered with the ``held`` cut."""

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}

    def open(self, sid: str, policy: ResumePolicy, budget: int | None) -> None:
        """Ask session ``sid``'s cut calls again as ``policy`` says; ``budget`` is its replies' token limit, if the
        session's defaults set one."""
        self._sessions[sid] = _Session(policy, budget)

    def forget(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def of(self, sid: str) -> Resumed:
        """What weight updates did to open session ``sid``'s model calls so far."""
        session = self._sessions.get(sid)
        return Resumed() if session is None else Resumed(session.calls, session.cut_tokens, session.limit)

    def asks_again(self, sid: str | None) -> bool:
        """Whether the call of session ``sid`` that SGLang just aborted is to be asked again, which it then is: the
        session is one this registry keeps, the trainer's rollout isn't over, and fewer of its calls than the
        policy's bound were asked again. Past the bound, notes why the episode ends there."""
        session = self._sessions.get(sid or "")
        if session is None or session.policy.rollout_over():
            return False
        if session.calls >= session.policy.max_calls:
            session.limit = (
                f"a weight update cut model call {session.calls + 1} of the episode to be asked again, past "
                f"{MAX_RESUMED_CALLS_SETTING}={session.policy.max_calls}; the episode ended there rather than span "
                "more weight updates"
            )
            logger.warning("[slime_helper] session %s: %s", sid, session.limit)
            return False
        session.calls += 1
        session.cutting = True
        return True

    def cutting(self, sid: str) -> bool:
        """Whether the turn session ``sid`` is serving was cut, to be asked again: nothing records it."""
        session = self._sessions.get(sid)
        return session is not None and session.cutting

    def held(self, sid: str | None) -> Cut | None:
        """The cut session ``sid``'s next request goes on from."""
        session = self._sessions.get(sid or "")
        return session.held if session is not None else None

    def recorded(self, sid: str, turn: Any) -> Any | None:
        """The turn to record for slime's ``TurnRecord`` ``turn`` of session ``sid``: ``turn`` itself, or, when it
        went on from a held cut, the cut's prompt with the cut and ``turn``'s tokens and logprobs after it. None when
        the turn was cut to be asked again: it is held instead, and nothing records it."""
        session = self._sessions.get(sid)
        if session is None:
            return turn
        cut, session.held = session.held, None
        if cut is not None:
            turn = replace(
                turn,
                prompt_ids=cut.prompt_ids,
                output_ids=[*cut.output_ids, *turn.output_ids],
                output_log_probs=[*cut.log_probs, *turn.output_log_probs],
            )
        if not session.cutting:
            return turn
        session.cutting = False
        session.cut_tokens += len(turn.output_ids) - (len(cut.output_ids) if cut is not None else 0)
        session.held = Cut(turn.prompt_ids, turn.output_ids, turn.output_log_probs)
        logger.debug(
            "[slime_helper] session %s: a weight update cut a reply at %d tokens; asking for the rest (%d of %d)",
            sid,
            len(turn.output_ids),
            session.calls,
            session.policy.max_calls,
        )
        return None

    def shorten(self, sid: str, body: dict[str, Any], keys: Sequence[str]) -> None:
        """Lower the token limit of session ``sid``'s request ``body`` by the tokens of the cut it goes on from, so
        the whole reply keeps to the limit: ``keys`` are the body's limit keys as the adapter reads them, the first
        taking precedence. A request going on from no cut, or whose limit is neither in the body nor the session's,
        is left as it is."""
        session = self._sessions.get(sid)
        if session is None or session.held is None:
            return
        asked = next((int(body[key]) for key in keys if body.get(key) is not None), None)
        limits = [limit for limit in (session.budget, asked) if limit is not None]
        if limits:
            body[keys[0]] = min(limits) - len(session.held.output_ids)


def ask_again_answer(sid: str, resumed: Resumed) -> web.Response:
    """The adapter's answer to a request whose model call a weight update cut: a 503, which chat_core sends again."""
    message = (
        f"a weight update cut this reply of session {sid}; send the same chat again and the reply goes on from where "
        f"it was cut ({resumed.calls} of the episode's model calls cut so far)"
    )
    return web.json_response(
        {"error": {"message": message, "type": "server_error", "code": "weight_update"}}, status=503
    )


class ResumingTokenizer:
    """The adapter's tokenizer (``tokenizer``), with a request that goes on from a held cut rendered as the cut's
    prompt followed by its tokens, and that request's reply decoded after the cut's tokens. Everything else is
    ``tokenizer``'s."""

    def __init__(self, tokenizer: Any, resumes: Resumes):
        self._tokenizer = tokenizer
        self._resumes = resumes

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = True,
    ) -> Any:
        """``tokenizer``'s rendering of ``conversation``, then, when the session of the request being served holds a
        cut, that cut's tokens. Raises RuntimeError when the chat sent again isn't rendered as the cut one was."""
        rendered = self._tokenizer.apply_chat_template(conversation, tools, tokenize, add_generation_prompt)
        cut = self._resumes.held(turn_session.get()) if tokenize and add_generation_prompt else None
        if cut is None:
            return rendered
        if list(rendered) != cut.prompt_ids:
            raise RuntimeError(
                f"session {turn_session.get()}: the chat sent again after a weight update cut its reply isn't the "
                "chat that was cut, so the reply can't go on from the cut"
            )
        _resuming.set(cut)
        return [*cut.prompt_ids, *cut.output_ids]

    def decode(self, token_ids: Sequence[int], *args: Any, **kwargs: Any) -> str:
        """``tokenizer``'s text of ``token_ids``, after the tokens of the cut the request being served goes on
        from, if any: the whole reply's text."""
        cut = _resuming.get()
        if cut is not None:
            token_ids = [*cut.output_ids, *token_ids]
        return self._tokenizer.decode(token_ids, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def resuming_manager(resumes: Resumes, fork_threshold_tokens: int | None) -> Any:
    """slime's ``TrajectoryManager`` (built with ``fork_threshold_tokens`` as slime's adapter builds it), recording
    each turn as ``resumes.recorded`` gives it."""
    return _resuming_manager(slime().TrajectoryManager)(resumes, fork_threshold_tokens=fork_threshold_tokens)


@functools.cache
def _resuming_manager(trajectory_manager: type) -> type:
    class ResumingTrajectoryManager(trajectory_manager):
        """slime's ``TrajectoryManager``; a turn a weight update cut is held rather than recorded, and the turn that
        goes on from it is recorded as one with it."""

        def __init__(self, resumes: Resumes, **kwargs: Any):
            super().__init__(**kwargs)
            self._resumes = resumes

        def record_turn(self, sid: str, *, turn: Any, **kwargs: Any) -> None:
            if (whole := self._resumes.recorded(sid, turn)) is not None:
                super().record_turn(sid, turn=whole, **kwargs)

    return ResumingTrajectoryManager
