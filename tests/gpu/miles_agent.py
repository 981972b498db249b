"""The Miles GPU run's agent: ``miles_helper``'s, limited to ``launches.MAX_TURNS`` env turns an episode, beside the
abort hook Miles looks for next to the agent it loads."""

from chat_core import Limits
from launches import MAX_TURNS
from miles_helper.agent import abort, make_agent

run = make_agent(Limits(max_turns=MAX_TURNS))

__all__ = ["abort", "run"]
