"""Why the helper refuses to start (every refusal is a ``SlimeSetupError`` whose message says what to change), or to
go on (``RolloutStarved``)."""


class SlimeSetupError(Exception):
    """slime, or the way it was launched, can't run this helper; the message says what to change."""


class UnsupportedSlime(SlimeSetupError):
    """The installed slime lacks part of the adapter or the hooks the helper uses."""


class MissingToolParser(SlimeSetupError):
    """slime was launched without ``--sglang-tool-call-parser``, so the adapter would read no tool call."""


class MissingEpisodeNormalization(SlimeSetupError):
    """slime normalises rewards per prompt group, but was launched without ``--custom-reward-post-process-path``, so
    an episode of several samples would be normalised against the whole batch, once per sample."""


class UnfilteredFullyAsync(SlimeSetupError):
    """slime's fully-async worker was named as ``--rollout-function-path`` itself: it never calls the dynamic filter,
    so a group holding an episode with no reward would be trained; ``slime_helper.generate_rollout_fully_async``
    runs the same worker with the filter."""


class AppendOnlyChatNeeded(SlimeSetupError):
    """slime's fully-async rollout takes one sample per episode, and the adapter doesn't render the chat append-only,
    so an episode may come back as several."""


class FullyAsyncEvaluation(SlimeSetupError):
    """slime's eval rollout can't run here beside its fully-async worker: both take slime's ``GenerateState``
    semaphore, which works on one event loop, so the eval must run on the loop the worker plays its episodes on."""


class PartialRolloutRefused(SlimeSetupError):
    """slime was launched with ``--partial-rollout``: an episode's env session ends with its rollout, so a partial
    sample can't go on in a later one."""


class UnreadableToolCalls(SlimeSetupError):
    """``--sglang-tool-call-parser`` doesn't read the tool calls the model's chat template writes, so every tool call
    would reach the env as text."""


class UnappendableChat(SlimeSetupError):
    """``episode_append_only_chat: true`` was set, but the model's chat template can't be rendered append-only."""


class UnsupportedTransformers(SlimeSetupError):
    """The installed transformers renders chat templates otherwise than the helper's checks need: it leaves a
    message's None-valued keys out, and the model's template writes tool calls only when a reply's content is None."""


class RolloutStarved(RuntimeError):
    """slime's fully-async rollout drew ``fully_async_max_drawn_batches`` batches' worth of groups and the dynamic
    filter kept too few of them; the message counts the drops by reason and says what to do."""
