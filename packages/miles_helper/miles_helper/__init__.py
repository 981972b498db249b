"""Miles' side of the trainer helpers: an agent function that plays a row's episode through Miles' session server,
the episode's reward as Miles' reward function, and the dynamic filter that keeps unscored episodes out of training.
Everything else (rows, the episode loop) is ``chat_core``'s, shared with slime's helper.

Launch flags: ``--custom-agent-function-path miles_helper.agent.run --custom-rm-path miles_helper.reward
--dynamic-sampling-filter-path miles_helper.keep_scored_nonzero_std_groups`` (or ``miles_helper.keep_scored_groups``)
``--custom-rollout-log-function-path miles_helper.log_rollout --custom-eval-rollout-log-function-path
miles_helper.log_eval_rollout`` (with ``--custom-generate-function-path
miles.rollout.generate_hub.agentic_tool_call.generate --use-session-server``). It imports Miles, so it runs in Miles'
environment.
"""

from chat_core import MissingFilter

from miles_helper.agent import abort, make_agent, run
from miles_helper.observability import log_eval_rollout, log_rollout
from miles_helper.scoring import keep_scored_groups, keep_scored_nonzero_std_groups, reward

__all__ = [
    "MissingFilter",
    "abort",
    "keep_scored_groups",
    "keep_scored_nonzero_std_groups",
    "log_eval_rollout",
    "log_rollout",
    "make_agent",
    "reward",
    "run",
]
