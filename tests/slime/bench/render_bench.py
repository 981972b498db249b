"""What rendering an episode's chat costs in slime's rollout process, and what slime then trains on, for every model
family slime's users train: a benchmark, not a test. slime's real ``OpenAIAdapter`` is built by
``slime_helper.AdapterService`` from slime's own ``parse_args`` and each family's real tokenizer and chat template
(``test_support.families``, in its first mode: thinking off where it has a switch), before
(``episode_append_only_chat: false``: the family's own template, every turn rendered and tokenized whole) and after
(what the helper picks: rendered append-only). The model is the tier's stand-in for SGLang's ``/generate``,
answering as the family's template writes a reply.

1. Render + tokenize CPU per model turn: episodes of 4 env turns of 3 tool calls and a reply (16 model calls) are
   sent to the adapter as chat_core sends them, and the adapter thread's CPU inside its tokenizer's
   ``apply_chat_template`` is read per call (``time.thread_time``); ``REPEATS`` episodes per side, before and after
   interleaved in ``ROUNDS`` rounds; min / median per turn, and of the 16 turns' sum per episode.
2. Tokens slime trains on for one synthetic episode of 4 env turns with 2 tool calls each and a 1,500-token system
   prompt: its samples, the sum of their lengths and of their trained tokens, and the tokens the model generated.

The machine's noise is a fixed 1,000-token tokenization timed the same way between the rounds. After, the trained
tokens must be exactly the generated ones (the benchmark stops with an error where they aren't); before, slime stops
training a reply wherever the template re-renders it otherwise in a later prompt, which the table shows.

Run: ``./bazelw run //tests/slime/bench:render [-- --smoke] [--family NAME]``; ``--smoke`` renders one episode a
side, once."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from argparse import Namespace
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from chat_core.prepare import write_rows
from launch import parse_slime_args, slime_command
from rollout import SAMPLE_PER_TURN, on_slime_loop
from sglang_stand_in import StandInSGLang
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample
from slime_helper import AdapterService
from slime_helper.tokenizers import turn_session
from test_support import serve_bundle, text, tool_call
from test_support.checkpoint import family_checkpoint
from test_support.families import FAMILIES, Family, Mode, written
from test_support.script import Reply, Step

REPO = Path(__file__).resolve().parents[3]
ROUNDS = 3
REPEATS = 12
TURNS_SHOWN = (1, 4, 8, 16)
SYSTEM_TOKENS = 1500
NOISE_TOKENS = 1000
ENV_TURNS = 4
PER_TURN_CALLS = 3
SYNTHETIC_CALLS = 2
PER_TURN = "bench: find three crates a turn"
SYNTHETIC = "bench: the synthetic episode"
REASONING = "I should look this up."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one episode a side in one round")
    parser.add_argument("--family", action="append", help="only this family (repeat it); all by default")
    options = parser.parse_args()
    rounds, repeats = (1, 1) if options.smoke else (ROUNDS, REPEATS)
    families = [family for family in FAMILIES if not options.family or family.name in options.family]
    server_python = os.environ.get("ENV_SERVER_PYTHON") or REPO / ".venv" / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="render-bench-") as scratch, serve_bundle(python=server_python) as served:
        rows = Path(scratch) / "rows"
        asyncio.run(write_rows(served.url, rows, progress=False))
        metadata = [json.loads(line)["metadata"] for line in (rows / "all.jsonl").read_text().splitlines()]
        [tools] = [row["tools"] for row in metadata if row["episode"]["task_name"] == "played"]
        config = Path(scratch) / "sample-per-turn.yaml"
        config.write_text(SAMPLE_PER_TURN)
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
        for family in families:
            mode = family.modes[0]
            checkpoint = family_checkpoint(Path(scratch) / family.name, family)
            tokenizer = load_tokenizer(str(checkpoint), trust_remote_code=True)
            scripts = {PER_TURN: _script_of(PER_TURN_CALLS), SYNTHETIC: _script_of(SYNTHETIC_CALLS)}
            script_of = _chosen_by_marker(scripts)
            with StandInSGLang(tokenizer, script_of=script_of) as sglang:
                sglang.writes = _writer(tokenizer, family, mode)
                flags = ["--sglang-tool-call-parser", family.tool_parser]
                if mode.template_kwargs:
                    flags += ["--apply-chat-template-kwargs", json.dumps(dict(mode.template_kwargs))]
                command = slime_command(checkpoint, (sglang.host, sglang.port), rows / "all.jsonl", {}, *flags)
                launches = {
                    "before": parse_slime_args([*command, "--custom-config-path", str(config)]),
                    "after": parse_slime_args(command),
                }
                print(f"\n## {family.name} ({mode.name})")
                _render_cost(launches, tokenizer, tools, rounds, repeats)
                _trained_tokens(launches, tools, _system_prompt(tokenizer), sglang)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


def _writer(tokenizer: Any, family: Family, mode: Mode) -> Callable[[Reply], list[int]]:
    def writes(reply: Reply) -> list[int]:
        return tokenizer.encode(written(tokenizer, family, mode, reply, REASONING), add_special_tokens=False)

    return writes


def _render_cost(
    launches: dict[str, Namespace], tokenizer: Any, tools: list[dict[str, Any]], rounds: int, repeats: int
) -> None:
    cpu: dict[str, dict[int, list[float]]] = {side: defaultdict(list) for side in launches}
    prompt_tokens: dict[int, int] = {}
    noise: list[float] = []
    reference = _text_of_tokens(tokenizer, NOISE_TOKENS)
    for _ in range(rounds):
        noise += _timed(lambda: tokenizer.encode(reference, add_special_tokens=False), 20)
        for side, args in launches.items():
            service = AdapterService.of(args)
            renders = _render_times(service)
            for _ in range(repeats // rounds):
                sid = f"bench-{uuid.uuid4().hex}"
                service.open_session(sid, {})
                system = "You keep a warehouse. " + PER_TURN
                on_slime_loop(_episode(service, sid, system, tools, _turns(PER_TURN_CALLS)))
                on_slime_loop(service.adapter.drop_session(sid))
                for turn, (seconds, tokens) in enumerate(renders.pop(sid), start=1):
                    cpu[side][turn].append(seconds * 1e3)
                    prompt_tokens[turn] = tokens
            AdapterService.reset()
    print(
        f"1. render + tokenize CPU per model turn, ms (adapter thread, {repeats} episodes a side in {rounds} "
        "interleaved rounds; min / median)"
    )
    print(f"{'turn':>4}  {'prompt tokens':>13}  {'before: min / median':>20}  {'after: min / median':>19}")
    for turn in TURNS_SHOWN:
        before, after = cpu["before"][turn], cpu["after"][turn]
        print(
            f"{turn:>4}  {prompt_tokens[turn]:>13}  {min(before):>9.3f} / {statistics.median(before):<8.3f}  "
            f"{min(after):>8.3f} / {statistics.median(after):<8.3f}"
        )
    episodes = {side: [sum(turns) for turns in zip(*per_turn.values(), strict=True)] for side, per_turn in cpu.items()}
    print(
        f"{'all':>4}  {'':>13}  {min(episodes['before']):>9.3f} / {statistics.median(episodes['before']):<8.3f}  "
        f"{min(episodes['after']):>8.3f} / {statistics.median(episodes['after']):<8.3f}"
    )
    print(
        f"noise: tokenizing a fixed {NOISE_TOKENS}-token text, {len(noise)} times between the rounds: min "
        f"{min(noise) * 1e3:.3f} ms, median {statistics.median(noise) * 1e3:.3f}, max {max(noise) * 1e3:.3f}"
    )


def _trained_tokens(
    launches: dict[str, Namespace], tools: list[dict[str, Any]], system: str, sglang: StandInSGLang
) -> None:
    print("2. the synthetic episode (4 env turns x 2 calls, a 1,500-token system prompt): samples, tokens, trained")
    for side, args in launches.items():
        service = AdapterService.of(args)
        sid = f"bench-{uuid.uuid4().hex}"
        service.open_session(sid, {})
        sglang.clear()
        on_slime_loop(_episode(service, sid, system, tools, _turns(SYNTHETIC_CALLS)))
        samples = on_slime_loop(
            service.adapter.finish_session(sid, base_sample=Sample(index=0, group_index=0, prompt=""), reward=1.0)
        )
        AdapterService.reset()
        generated = sum(len(reply.output) for reply in sglang.generated)
        trained = sum(sum(s.loss_mask) for s in samples)
        print(
            f"{side:>6}  {len(samples):>3} samples  {sum(len(s.tokens) for s in samples):>6} tokens  "
            f"{trained:>5} trained of {generated} generated"
        )
        if side == "after" and (len(samples), trained) != (1, generated):
            raise SystemExit(
                f"rendered append-only, the episode came back as {len(samples)} samples training {trained}"
            )


def _render_times(service: AdapterService) -> dict[str, list[tuple[float, int]]]:
    """Each session's renders on ``service``'s adapter from now on: CPU seconds of the adapter's thread in its
    tokenizer's ``apply_chat_template``, and the prompt's length, per model call in order."""
    times: dict[str, list[tuple[float, int]]] = defaultdict(list)
    tokenizer = service.adapter.tokenizer
    render = tokenizer.apply_chat_template

    def timed(conversation: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        rendered = render(conversation, **kwargs)
        times[turn_session.get()].append((time.thread_time() - began, len(rendered)))
        return rendered

    tokenizer.apply_chat_template = timed
    return times


async def _episode(
    service: AdapterService, sid: str, system: str, tools: list[dict[str, Any]], turns: Sequence[str]
) -> None:
    """Play ``turns`` (each env turn's user message) with the model behind ``service``'s adapter as chat_core does:
    each reply goes back as the model's message, each tool call is answered, and a reply without one ends the
    turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    chat = service.chat(sid)
    async with aiohttp.ClientSession(headers=dict(chat.headers)) as session:
        for prompt in turns:
            messages.append({"role": "user", "content": prompt})
            while True:
                body = {"model": chat.model, "messages": messages, "tools": tools}
                async with session.post(chat.url, json=body) as answer:
                    answer.raise_for_status()
                    message = (await answer.json())["choices"][0]["message"]
                messages.append({key: value for key, value in message.items() if value is not None})
                calls = message.get("tool_calls") or []
                for call in calls:
                    crate = json.loads(call["function"]["arguments"])["name"]
                    shelf = f"The crate '{crate}' is on shelf {len(crate)}C."
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": shelf})
                if not calls:
                    break


def _turns(calls: int) -> list[str]:
    """Each env turn's user message, asking for ``calls`` crates."""
    return [f"Find the crates {', '.join(crates)}." for crates in _crates(calls)]


def _script_of(calls: int) -> list[Step]:
    """The model's replies to ``_turns(calls)``: per env turn, a tool call a crate, then an answer naming them."""
    steps: list[Step] = []
    for crates in _crates(calls):
        steps += [tool_call("find_crate", {"name": crate}) for crate in crates]
        steps.append(text(f"The crates {', '.join(crates)} are on their shelves."))
    return steps


def _crates(calls: int) -> list[list[str]]:
    """Per env turn, the ``calls`` crates it asks for."""
    fruit = ["apples", "pears", "plums", "figs", "limes", "kiwis", "dates", "grapes", "lemons", "melons", "cherries"]
    return [[f"{fruit[(turn * calls + at) % len(fruit)]}-{turn}" for at in range(calls)] for turn in range(ENV_TURNS)]


def _chosen_by_marker(scripts: dict[str, list[Step]]) -> Callable[[str], Sequence[Step]]:
    """A ``script_of`` giving a session the script whose marker its first prompt holds."""

    def script_of(prompt: str) -> Sequence[Step]:
        [steps] = [steps for marker, steps in scripts.items() if marker in prompt]
        return steps

    return script_of


def _system_prompt(tokenizer: Any) -> str:
    """A system prompt of about ``SYSTEM_TOKENS`` tokens, naming the synthetic episode."""
    return "You keep a warehouse. " + SYNTHETIC + ". " + _text_of_tokens(tokenizer, SYSTEM_TOKENS)


def _text_of_tokens(tokenizer: Any, tokens: int) -> str:
    rule = "Every crate has a shelf, every shelf a number and a letter, and every answer names the shelf it read. "
    text_ = rule * (tokens // len(tokenizer.encode(rule, add_special_tokens=False)) + 1)
    return tokenizer.decode(tokenizer.encode(text_, add_special_tokens=False)[:tokens])


def _timed(work: Callable[[], object], times: int) -> list[float]:
    seconds = []
    for _ in range(times):
        began = time.thread_time()
        work()
        seconds.append(time.thread_time() - began)
    return seconds


if __name__ == "__main__":
    sys.exit(main())
