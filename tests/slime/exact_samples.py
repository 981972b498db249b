"""The checks that an episode slime's adapter played came back exact, for any episode a test plays: every prompt the
adapter rendered, token for token against the chat template's own render of the chat (``slime_helper.template_match``:
a prompt rendered whole must be exactly the template's render; an appended one may differ only as
``ALLOWED_DIFFERENCES`` name), and every token the model generated trained exactly once, in the context the model
generated it in, with its logprob, and nothing else trained.

``exact_episode`` takes the played samples of one episode, the prompts the adapter rendered for its session (each
with the chat and tools it rendered and the token ids, as ``Prompts`` keeps them), the replies the stand-in for
SGLang generated for that session (each with its prompt, output token ids and logprobs, as
``sglang_stand_in.StandInSGLang.generated`` keeps them), in order, and the family's template."""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
from slime_helper.chat_template import ChatTemplate
from slime_helper.renderer import AppendOnlyRenderer
from slime_helper.template_match import Difference, SampledReply, differences
from slime_helper.tokenizers import turn_session


@dataclass(frozen=True)
class Render:
    """A prompt slime's adapter asked its tokenizer for: the session, the chat and tools it rendered, the token ids,
    and how many of them the render tokenized (the rest it already held)."""

    sid: str | None
    conversation: list[dict[str, Any]]
    tools: Any
    tokens: list[int]
    tokenized: int


class Prompts:
    """Every prompt slime's adapter asks its tokenizer for (``rendered``), with the number of tokens the tokenizer
    class's ``encode`` gave while the prompt was rendered."""

    def __init__(self, adapter_tokenizer: Any, tokenizer_class: type, monkeypatch: pytest.MonkeyPatch):
        self._render = adapter_tokenizer.apply_chat_template
        self._rendering = threading.local()
        self.rendered: list[Render] = []
        encode = tokenizer_class.encode
        rendering = self._rendering

        def counted(tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
            ids = encode(tokenizer, *args, **kwargs)
            if getattr(rendering, "tokenized", None) is not None:
                rendering.tokenized += len(ids)
            return ids

        monkeypatch.setattr(tokenizer_class, "encode", counted)
        monkeypatch.setattr(adapter_tokenizer, "apply_chat_template", self)

    def __call__(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        self._rendering.tokenized = 0
        try:
            rendered = self._render(conversation, **kwargs)
            tokenized = self._rendering.tokenized
        finally:
            self._rendering.tokenized = None
        self.rendered.append(
            Render(turn_session.get(), copy.deepcopy(conversation), kwargs.get("tools"), list(rendered), tokenized)
        )
        return rendered

    def of(self, sid: str) -> list[Render]:
        """The prompts rendered for session ``sid``, in order."""
        return [render for render in self.rendered if render.sid == sid]


class RenderedPrompt(Protocol):
    conversation: list[dict[str, Any]]
    tools: Any
    tokens: list[int]


class GeneratedReply(Protocol):
    prompt: list[int]
    output: list[int]
    logprobs: list[float]


def exact_episode(
    samples: Sequence[Any],
    prompts: Sequence[RenderedPrompt],
    replies: Sequence[GeneratedReply],
    template: ChatTemplate,
) -> frozenset[Difference]:
    """Assert that the episode of ``samples`` is exact (see the module), and return the allowed differences its
    prompts showed. ``prompts`` may hold one more than ``replies``: a prompt the adapter refused to send."""
    assert len(replies) <= len(prompts) <= len(replies) + 1, f"{len(prompts)} prompts for {len(replies)} replies"
    for at, (prompt, reply) in enumerate(zip(prompts, replies, strict=False)):
        assert list(prompt.tokens) == list(reply.prompt), f"model call {at + 1} got another prompt than was rendered"
    found = prompts_differences(prompts, replies, template)
    assert_trained_once(samples, replies)
    return found


def prompts_differences(
    prompts: Sequence[RenderedPrompt], replies: Sequence[GeneratedReply], template: ChatTemplate
) -> frozenset[Difference]:
    """The allowed differences between the appended ``prompts`` and the template's render of their chats, each
    prompt rendered whole asserted to be exactly the template's render. Raises TemplateMismatch for another
    difference."""
    renderer = AppendOnlyRenderer(template)
    found: set[Difference] = set()
    places: list[SampledReply] = []
    held: list[int] | None = None
    for at, prompt in enumerate(prompts):
        tokens = list(prompt.tokens)
        earlier = sum(message.get("role") == "assistant" for message in prompt.conversation)
        if held is not None and tokens[: len(held)] == held:
            found |= differences(renderer, prompt.conversation, prompt.tools, tokens, places)
        else:
            whole = template.ids(template.text(prompt.conversation, prompt.tools, generation_prompt=True))
            assert tokens == whole, f"model call {at + 1}'s prompt was rendered whole, but not as the template does"
            # The replies before a prompt rendered whole are in it as the template wrote them, not as sampled.
            places = [SampledReply(0, len(tokens))] * earlier
        if at < len(replies):
            places = [*places, SampledReply(len(tokens), len(tokens) + len(replies[at].output))]
            held = [*tokens, *replies[at].output]
    return frozenset(found)


def assert_trained_once(samples: Sequence[Any], replies: Sequence[GeneratedReply]) -> None:
    """Assert that each of ``replies`` is trained (loss mask 1, its logprobs) in exactly one of ``samples``, after
    exactly the prompt it was generated from, and that no other token of them is trained."""
    for at, reply in enumerate(replies):
        if not reply.output:
            continue
        places = [sample for sample in samples if _trained_after_its_prompt(sample, reply)]
        assert len(places) == 1, f"reply {at + 1} is trained in {len(places)} samples, not one"
    trained = sum(sum(sample.loss_mask) for sample in samples)
    assert trained == sum(len(reply.output) for reply in replies), "tokens the model didn't generate are trained"


def _trained_after_its_prompt(sample: Any, reply: GeneratedReply) -> bool:
    """Whether ``sample`` holds ``reply`` after its prompt, with loss mask 1 and its logprobs on every token."""
    start, end = len(reply.prompt), len(reply.prompt) + len(reply.output)
    response = len(sample.tokens) - sample.response_length
    if start < response or list(sample.tokens[:end]) != [*reply.prompt, *reply.output]:
        return False
    return sample.loss_mask[start - response : end - response] == [1] * len(reply.output) and (
        sample.rollout_log_probs[start - response : end - response] == list(reply.logprobs)
    )
