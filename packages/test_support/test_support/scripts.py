"""The sample bundle and, for each of its tasks, the scripted model replies every test tier plays it with.

Each script is the model's side of one episode, a reply per request: a tool call is followed by the reply after
its result, and a two-turn task gets a reply for each turn. ``REWARDS`` is what the server answers for each task
played with its script: None where the run fails after the turn.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from .script import Step, text, tool_call

SAMPLE_BUNDLE = Path(__file__).resolve().parent / "bundles" / "sample-env"
SAMPLE_ENV = "sample-env"

PLAYED: tuple[Step, ...] = (
    tool_call("find_crate", {"name": "pears"}),
    text("The crate of pears is on shelf 9C."),
)
SCORES_ZERO: tuple[Step, ...] = (text("A cherry."),)
TWO_TURNS: tuple[Step, ...] = (text("Welcome to the warehouse!"), text("Goodbye, and thank you!"))
ADDS_A_CRATE: tuple[Step, ...] = (
    tool_call("add_crate", {"name": "oranges"}),
    text("I added the crate of oranges."),
)
FAILS_AFTER_THE_TURN: tuple[Step, ...] = (text("The night shift may start."),)
REPLY_ONLY: tuple[Step, ...] = (text("A banana."),)

SCRIPTS: MappingProxyType[str, tuple[Step, ...]] = MappingProxyType(
    {
        "played": PLAYED,
        "scores_zero": SCORES_ZERO,
        "two_turns": TWO_TURNS,
        "adds_a_crate": ADDS_A_CRATE,
        "fails_after_the_turn": FAILS_AFTER_THE_TURN,
        "reply_only": REPLY_ONLY,
    }
)
TASKS: tuple[str, ...] = tuple(SCRIPTS)
REWARDS: MappingProxyType[str, float | None] = MappingProxyType(
    {
        "played": 1.0,
        "scores_zero": 0.0,
        "two_turns": 1.0,
        "adds_a_crate": 1.0,
        "fails_after_the_turn": None,
        "reply_only": 1.0,
    }
)
