"""Why the helper refuses to start: every refusal is a ``SlimeSetupError`` whose message says what to change."""


class SlimeSetupError(Exception):
    """slime, or the way it was launched, can't run this helper; the message says what to change."""


class UnsupportedSlime(SlimeSetupError):
    """The installed slime lacks part of the adapter or the hooks the helper uses."""


class MissingToolParser(SlimeSetupError):
    """slime was launched without ``--sglang-tool-call-parser``, so the adapter would read no tool call."""


class MissingFilter(SlimeSetupError):
    """slime was launched without ``--dynamic-sampling-filter-path``, so an unscored episode would train as 0."""
