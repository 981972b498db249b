"""Runs pytest on the test files Bazel passes as arguments, so a py_test target's output is pytest's own."""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-p", "no:cacheprovider", "-q", "-rfE", *sys.argv[1:]]))
