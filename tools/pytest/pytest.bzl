"""Test macros: pytest under Bazel in the dev environment or in a trainer environment, and the ruff check."""

load("@rules_python//python:defs.bzl", "py_test")

# The dev environment is synced from uv.lock outside Bazel's view; naming the lock makes a test rerun when it changes.
_DEV_ENV = ["//:uv.lock"]

def py_pytest(name, srcs, deps = [], data = [], **kwargs):
    """A py_test that runs pytest on `srcs` with the dev environment's interpreter."""
    py_test(
        name = name,
        srcs = srcs + ["//tools/pytest:pytest_main.py"],
        main = "//tools/pytest:pytest_main.py",
        args = ["$(rootpath %s)" % src for src in srcs],
        deps = deps,
        data = data + _DEV_ENV,
        python_version = "PY3",
        **kwargs
    )

# The pins and the environment builder, which test_support.trainer_env (and a tier's own tests) import as `pins` and
# `build_env`; _env_data brings their files into every trainer-environment target's runfiles.
_TOOL_DIRS = ["third_party", "tools/envs"]

def _env_command(env, packages, imports):
    """The run_in_env.sh arguments that come before the Python arguments: the environment, and the runfiles folders
    put on PYTHONPATH (each package's, the tools', then `imports`)."""
    return [
        env,
        "$(rootpath @python_venv//:paths.sh)",
        ",".join(["packages/%s" % package for package in packages] + _TOOL_DIRS + imports),
        "--",
    ]

def _env_data(packages):
    """What a trainer-environment target reads: the environment is built from the specs and pins (so naming them
    makes a cached result stale exactly when the environment would be rebuilt), and the env server runs in the dev
    environment."""
    return (["@python_venv//:paths.sh", "//tools/envs:specs", "//third_party:pins_lib"] + _DEV_ENV +
            ["//packages/%s" % package for package in packages])

def env_pytest(name, env, srcs, packages, imports = [], data = [], test_env = {}, **kwargs):
    """An sh_test that runs pytest on `srcs` inside trainer environment `env` (slime or miles).

    `packages` names the project's packages (e.g. "chat_core") to put on PYTHONPATH from the runfiles, and `imports`
    other runfiles folders of modules the tests import (e.g. "tests/gpu", whose files `data` must bring); the
    environment itself is the one ./bazelw built from the specs and pins and linked at .venvs/<env>. The target runs
    alone (each tier starts several servers on a small machine); the env server still runs with the dev
    environment's interpreter. `test_env` sets environment variables for the test, with $(rootpaths …) of `data`
    expanded.
    """
    native.sh_test(
        name = name,
        srcs = ["//tools/pytest:run_in_env.sh"],
        args = _env_command(env, packages, imports) + ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE"] +
               ["$(rootpath %s)" % src for src in srcs],
        data = srcs + data + _env_data(packages),
        env = test_env,
        tags = ["exclusive"],
        **kwargs
    )

def trainer_tier(env, packages, support, launch_support = []):
    """The three test targets of trainer `env`'s tier, each run in its environment:

    - `<env>_test`: every `*_test.py` but the two below, with `support` (conftest and stand-ins) beside them;
    - `gpu_launch_test`: the GPU run's launch (//tests/gpu, importable as `launches`) parsed by the trainer's own
      parse_args, with `launch_support`;
    - `wheels_test`: the wheels installed into a copy of the environment, and the GPU command run from them up to its
      Ray job (the wheels' paths in WHEELS, the launch importable as `launches`).
    """
    own = ["gpu_launch_test.py", "wheels_test.py"]
    env_pytest(
        name = "%s_test" % env,
        size = "large",
        srcs = native.glob(["*_test.py"], exclude = own),
        data = support,
        env = env,
        packages = packages,
    )
    env_pytest(
        name = "gpu_launch_test",
        size = "large",
        srcs = ["gpu_launch_test.py"],
        data = launch_support + ["//tests/gpu:launches"],
        env = env,
        imports = ["tests/gpu"],
        packages = packages,
    )
    env_pytest(
        name = "wheels_test",
        size = "large",
        srcs = ["wheels_test.py"],
        data = ["//packages:wheels", "//tests/gpu:launches"],
        env = env,
        imports = ["tests/gpu"],
        packages = ["test_support"],
        test_env = {"WHEELS": "$(rootpaths //packages:wheels)"},
    )

def env_binary(name, env, main, packages, imports = [], data = [], **kwargs):
    """An sh_binary that runs the Python script `main` inside trainer environment `env`, for `bazel run`, with the
    runfiles folders `imports` on the path as `env_pytest` puts them."""
    native.sh_binary(
        name = name,
        srcs = ["//tools/pytest:run_in_env.sh"],
        args = _env_command(env, packages, imports) + ["$(rootpath %s)" % main],
        data = [main] + data + _env_data(packages),
        **kwargs
    )

def ruff_test(name):
    """Ruff lint and format check over the whole checkout; tagged external so it never comes from the cache."""
    py_test(
        name = name,
        srcs = ["//tools/pytest:ruff_main.py"],
        main = "//tools/pytest:ruff_main.py",
        args = ["$(rootpath @python_venv//:paths.sh)"],
        data = ["@python_venv//:paths.sh"],
        python_version = "PY3",
        tags = ["external"],
    )
