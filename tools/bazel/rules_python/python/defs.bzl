"""The native Python rules under the names @rules_python exports, so BUILD files read as with real rules_python."""

py_binary = native.py_binary
py_library = native.py_library
py_runtime = native.py_runtime
py_test = native.py_test
