"""``python -m chat_core.evaluate ROWS --model-url URL --model NAME --out DIR``; Bazel's ``evaluate`` target runs
this file."""

import sys

from chat_core.evaluate.command import main

if __name__ == "__main__":
    sys.exit(main())
