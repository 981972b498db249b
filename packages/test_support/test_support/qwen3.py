"""A scripted reply as Qwen3 writes it, and the tokens SGLang reports for it.

slime's adapter and Miles' session server both train on the token ids and logprobs SGLang returns, so the tiers'
stand-ins for SGLang answer a scripted reply with the ids Qwen3's tokenizer gives the text its chat template renders
for that reply, closed with ``<|im_end|>`` as the model stops. The tokenizer is the caller's, which keeps this module
free of any dependency.
"""

from __future__ import annotations

from typing import Any

from .script import Reply

END_OF_TURN = "<|im_end|>"


def qwen3_text(reply: Reply) -> str:
    """What Qwen3 writes for ``reply``, up to the end-of-turn token: its text, then each tool call as
    ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``, its arguments as the script gave them, which is
    how Qwen3's chat template renders a reply."""
    parts = [reply.content] if reply.content else []
    parts += [
        '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + call.arguments + "}\n</tool_call>"
        for call in reply.tool_calls
    ]
    return "\n".join(parts)


def output_token_logprobs(tokenizer: Any, reply: Reply) -> list[list[Any]]:
    """SGLang's ``output_token_logprobs`` for ``reply``: ``[logprob, token id, None]`` for each token ``tokenizer``
    (Qwen3's, from ``transformers``) gives ``qwen3_text(reply)``, then for ``<|im_end|>``; each logprob is a small
    negative number."""
    ids = [*tokenizer.encode(qwen3_text(reply), add_special_tokens=False), tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    return [[-0.01 * (position % 50 + 1), token, None] for position, token in enumerate(ids)]
