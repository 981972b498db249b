"""``python -m chat_core.evaluate``: a model's reward on a prepare folder's rows against any OpenAI-compatible chat
endpoint, without a trainer."""
