"""Registers this checkout's uv-managed `.venv` as Bazel's Python toolchain, and the trainer environments' paths.

The interpreter path Bazel needs is absolute, so it is found per checkout instead of committed: the rule resolves
the workspace root from a label and writes a small repository around `<root>/.venv/bin/python`. It also records
where README's wrapper links the slime and Miles environments (`<root>/.venvs/<name>`), which the trainer tiers run
in.
"""

_BUILD = """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

py_runtime(
    name = "venv_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "venv_runtime_pair",
    py3_runtime = ":venv_runtime",
)

toolchain(
    name = "venv_toolchain",
    toolchain = ":venv_runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

exports_files(["paths.sh"])
"""

def _python_venv_impl(ctx):
    root = ctx.path(Label("//:WORKSPACE")).dirname
    python = root.get_child(".venv").get_child("bin").get_child("python")
    ctx.file("BUILD.bazel", _BUILD.format(python = python))
    ctx.file("paths.sh", "\n".join([
        "WORKSPACE_ROOT='{}'".format(root),
        "DEV_PYTHON='{}'".format(python),
        "",
    ]))

python_venv = repository_rule(
    implementation = _python_venv_impl,
    local = True,
    doc = "The checkout's .venv as the Python toolchain, plus paths.sh naming the checkout's root.",
)
