"""The episode loop: ``play`` plays a row's episode with the trainer's model on the env server that serves it, and
returns its record (``chat_core.record.results``)."""
