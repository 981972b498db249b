"""A GRPO run of slime or Miles on a GPU box, on the tasks of a served bundle: ``python -m chat_core.prepare`` writes
the bundle's rows into the run's folder, then the trainer's ``train.py`` runs as a Ray job, on a Ray head this
command starts and stops, with the arguments ``launches.py`` builds.

    python3 tests/gpu/run.py slime --model /root/Qwen3-4B-sft --bundle-url http://HOST:PORT --gpus 4

Run it with the trainer image's Python, into which the wheels of ``chat_core`` and the trainer's helper are
installed. Before Ray starts, the trainer's own loader resolves every function the launch names, so a missing wheel
fails in seconds. Arguments after ``--`` go to ``train.py`` after the launch's own, so they override them (e.g.
``-- --attention-backend unfused`` on GPUs without FlashAttention).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from launches import Run, function_paths, miles_args, slime_args, write_slime_config

HERE = Path(__file__).resolve().parent
LOADERS = {"slime": "slime.utils.misc", "miles": "miles.utils.misc"}
CHECKOUTS = {"slime": "/root/slime", "miles": "/root/miles"}
RAY_ADDRESS = "http://127.0.0.1:8265"
_RESOLVE = """
import sys
from {loader} import load_function
for path in sys.argv[1:]:
    try:
        load_function(path)
    except Exception as e:
        sys.exit(f"{{path}}: {{type(e).__name__}}: {{e}}")
"""


def main(argv: list[str]) -> int:
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = _parser().parse_args(ours)
    here = Path(os.environ.get("BUILD_WORKING_DIRECTORY", "."))
    out = here / (args.out or Path("gpu-runs") / f"{args.trainer}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    run = Run(
        model=(here / args.model).resolve(), folder=out, gpus=args.gpus, steps=args.steps, eval_every=args.eval_every
    )
    if subprocess.run([sys.executable, "-m", "chat_core.prepare", args.bundle_url, str(run.rows)]).returncode != 0:
        return 1
    if args.trainer == "slime":
        write_slime_config(run)
        train_args = slime_args(run)
        job_env = {"PYTHONPATH": args.megatron_dir, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    else:
        train_args = miles_args(run)
        job_env = {"PYTHONPATH": str(HERE)}
    job_env["PYTHONUNBUFFERED"] = "1"
    _resolve_functions(args.trainer, function_paths(train_args).values(), job_env["PYTHONPATH"])
    checkout = Path(args.trainer_dir or os.environ.get(f"{args.trainer.upper()}_DIR", CHECKOUTS[args.trainer]))
    train = [sys.executable, str(checkout / "train.py"), *train_args, *extra]
    (out / "train-command.json").write_text(json.dumps({"env": job_env, "command": train}, indent=2) + "\n")
    ray_head = ["ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--num-gpus", str(args.gpus)]
    subprocess.run([*ray_head, "--disable-usage-stats"], check=True)
    try:
        job = [
            "ray",
            "job",
            "submit",
            "--address",
            RAY_ADDRESS,
            "--runtime-env-json",
            json.dumps({"env_vars": job_env}),
        ]
        return subprocess.run([*job, "--", *train], check=False).returncode
    finally:
        subprocess.run(["ray", "stop", "--force"], check=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 tests/gpu/run.py",
        description="GRPO on a served bundle's tasks with slime or Miles, in the trainer's image.",
        epilog="Arguments after -- go to the trainer's train.py.",
    )
    parser.add_argument("trainer", choices=sorted(LOADERS))
    _from_env(parser, "--model", "MODEL_PATH", str, "the SFT checkpoint, a Hugging Face folder")
    _from_env(parser, "--bundle-url", "BUNDLE_URL", str, "the OpenEnv server serving the bundle")
    _from_env(parser, "--gpus", "NUM_GPUS", int, "GPUs on this node, all used by the run")
    parser.add_argument("--out", type=Path, help="the run's folder (default gpu-runs/<trainer>-<time>)")
    parser.add_argument("--steps", type=int, default=Run.steps, help=f"training steps (default {Run.steps})")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=Run.eval_every,
        help=f"steps between evals of the bundle's eval splits (default {Run.eval_every})",
    )
    parser.add_argument(
        "--trainer-dir",
        help="the trainer's checkout holding train.py (default $SLIME_DIR or /root/slime, $MILES_DIR or /root/miles)",
    )
    parser.add_argument(
        "--megatron-dir",
        default=os.environ.get("MEGATRON_DIR", "/root/Megatron-LM"),
        help="Megatron-LM's checkout, on slime's path (default $MEGATRON_DIR or /root/Megatron-LM)",
    )
    return parser


def _from_env(parser: argparse.ArgumentParser, flag: str, variable: str, kind: type, help: str) -> None:
    """``flag``, defaulting to environment variable ``variable`` and required when that isn't set."""
    value = os.environ.get(variable)
    parser.add_argument(
        flag,
        type=kind,
        default=None if value is None else kind(value),
        required=value is None,
        help=f"{help} (default ${variable})",
    )


def _resolve_functions(trainer: str, paths: Iterable[str], pythonpath: str) -> None:
    """Load each of ``paths`` with the trainer's own loader on the job's path; exit saying which fails."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    code = _RESOLVE.format(loader=LOADERS[trainer])
    if subprocess.run([sys.executable, "-c", code, *paths], env=env, check=False).returncode != 0:
        sys.exit(
            f"run.py: {trainer} can't load a function the launch names (above): install the wheels of chat_core and "
            f"the {trainer} helper into {sys.executable}"
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
