#!/bin/sh
echo "coverage is not available: this Bazel runs offline without Bazel's coverage tools" >&2
exit 1
