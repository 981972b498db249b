"""`trainer_helper`: the targets every trainer's helper package has, so slime's and Miles' stay alike."""

load("@rules_python//python:defs.bzl", "py_binary", "py_library")
load("//tools/wheel:wheel.bzl", "pep517_wheel")

def trainer_helper(name, version):
    """The helper package `name` (e.g. slime_helper) in the calling BUILD file's folder: its library, the
    trainer-named `prepare` command (chat_core's one implementation, only named here) and its wheel."""
    sources = native.glob(["%s/**/*.py" % name])
    py_library(
        name = name,
        srcs = sources,
        imports = ["."],
        visibility = ["//visibility:public"],
        deps = ["//packages/chat_core"],
    )
    py_binary(
        name = "prepare",
        srcs = ["//packages/chat_core:chat_core/prepare/__main__.py"],
        main = "//packages/chat_core:chat_core/prepare/__main__.py",
        visibility = ["//tests:__subpackages__"],
        deps = ["//packages/chat_core"],
    )
    pep517_wheel(
        name = "wheel",
        srcs = ["pyproject.toml"] + sources,
        distribution = name,
        version = version,
        visibility = ["//packages:__pkg__"],
    )
