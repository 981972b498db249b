"""``python -m chat_core.prepare URL OUT``; Bazel's ``prepare`` targets run this file."""

import sys

from chat_core.prepare.command import main

if __name__ == "__main__":
    sys.exit(main())
