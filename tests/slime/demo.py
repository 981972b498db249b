"""The slime helper end to end on CPU: serve the sample bundle, write its rows, and play every row through
``slime_helper.generate.generate`` as slime's rollout does, on slime's real ``OpenAIAdapter`` with Qwen3's tokenizer
and a stand-in for SGLang's ``/generate`` that answers with test_support's scripted replies. It prints, per episode,
its reward, the samples slime would train on and the episode's flags, and what slime's dynamic filter does with each
group; then slime's own eval of the eval split, one sample per episode.

    PYTHONPATH=third_party python3.11 tools/envs/build_env.py slime
    PYTHONPATH=packages/chat_core:packages/slime_helper:packages/test_support \\
        .venvs/slime/bin/python tests/slime/demo.py [--thinking-off]

The env server runs on the Python that ``ENV_SERVER_PYTHON`` names, by default ``.venv/bin/python``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from chat_core import EpisodeOutcome
from chat_core.prepare import write_rows
from launch import EVAL_SPLIT, THINKING_OFF, parse_slime_args, slime_command
from rollout import on_slime_loop, sampling_params, split_response
from sglang_stand_in import StandInSGLang, by_task
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.filter_hub.base_types import call_dynamic_filter
from slime.rollout.sglang_rollout import eval_rollout_single_dataset, generate_and_rm_group
from slime.utils.misc import load_function
from slime.utils.processing_utils import load_tokenizer
from slime_helper import AdapterService
from test_support import serve_bundle
from test_support.checkpoint import QWEN3_0_6B, weightless_checkpoint

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--thinking-off", action="store_true", help=f"launch slime with {' '.join(THINKING_OFF)}")
    thinking_off = parser.parse_args(argv).thinking_off
    began = time.monotonic()
    server_python = os.environ.get("ENV_SERVER_PYTHON") or REPO / ".venv" / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="slime-demo-") as scratch, serve_bundle(python=server_python) as served:
        print(f"env server: {served.url} serving {served.env_name!r}")
        rows = Path(scratch) / "rows"
        counts = asyncio.run(write_rows(served.url, rows, progress=False))
        print(f"rows: {', '.join(f'{split} {count}' for split, count in counts.items())} in {rows}")
        checkpoint = weightless_checkpoint(Path(scratch) / "Qwen3-0.6B", QWEN3_0_6B)
        with StandInSGLang(load_tokenizer(str(checkpoint)), script_of=by_task(served)) as sglang:
            command = slime_command(
                checkpoint,
                (sglang.host, sglang.port),
                rows / "all.jsonl",
                {EVAL_SPLIT: rows / f"{EVAL_SPLIT}.jsonl"},
                "--sglang-tool-call-parser", "qwen25",
                *(THINKING_OFF if thinking_off else []),
            )  # fmt: skip
            args = parse_slime_args(command)
            logging.getLogger().setLevel(logging.WARNING)
            print("slime launch: " + " ".join(command[1:]))
            groups = RolloutDataSource(args).get_samples(counts["all"])
            played = on_slime_loop(_all(args, groups))
            for group in played:
                _report(args, group)
            for dataset in args.eval_datasets:
                evaluated = on_slime_loop(eval_rollout_single_dataset(args, 0, dataset))[dataset.name]
                _report_eval(dataset.name, evaluated["samples"])
            AdapterService.reset()
    print(f"done in {time.monotonic() - began:.1f} s")
    return 0


async def _all(args, groups: list[list]) -> list:
    return await asyncio.gather(*(generate_and_rm_group(args, group, sampling_params(args)) for group in groups))


def _report(args, group: list) -> None:
    for episode in group:
        first = episode[0]
        outcome = EpisodeOutcome.from_metadata(first.metadata)
        flags = ", ".join(f"{flag.kind}: {flag.message}" for flag in outcome.flags) or "none"
        print(
            f"{first.metadata['episode']['task_name']:<22} reward {first.reward:.1f}  "
            f"scored {outcome.scored!s:<5}  {len(episode)} sample(s)  flags: {flags}"
        )
        for sample in episode:
            trained, masked = split_response(sample)
            print(
                f"    sample: status {sample.status.value}, {len(sample.tokens)} tokens, response "
                f"{sample.response_length} ({len(trained)} trained, {len(masked)} masked), reward {sample.reward}"
            )
    verdict = call_dynamic_filter(load_function(args.dynamic_sampling_filter_path), args, group)
    print(f"    group: {'kept' if verdict.keep else f'left out by the filter ({verdict.reason})'}")


def _report_eval(name: str, samples: list) -> None:
    rewards = [sample.reward for sample in samples]
    episodes = ", ".join(f"{sample.metadata['episode']['task_name']} {sample.reward:.1f}" for sample in samples)
    print(f"eval {name}: {len(samples)} samples, mean reward {sum(rewards) / len(rewards):.2f} ({episodes})")


if __name__ == "__main__":
    sys.exit(main())
