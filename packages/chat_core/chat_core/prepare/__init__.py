"""The rows: a trainer's dataset rows for an env server's tasks (``rows``, plain data that loads no client) and
``python -m chat_core.prepare``, which writes them."""
