#!/usr/bin/env bash
# Runs Python inside one of the trainer environments (slime or Miles) that ./bazelw links at .venvs/<name>, with the
# runfiles folders IMPORT_DIRS (comma-separated, relative to the workspace: the project's packages, the pins' and the
# environment builder's folders, ...) on PYTHONPATH and the env server on the dev environment's interpreter.
# Usage: run_in_env.sh ENV PATHS_SH IMPORT_DIRS -- PYTHON_ARGS...
set -euo pipefail
env_name=$1 paths_sh=$2 import_dirs=$3
shift 3
[[ $1 == -- ]] && shift
# shellcheck source=/dev/null
source "$paths_sh"
runfiles=${RUNFILES_DIR:-$PWD/..}
python=$WORKSPACE_ROOT/.venvs/$env_name/bin/python
if [[ ! -x $python ]]; then
  echo "The $env_name environment is missing ($WORKSPACE_ROOT/.venvs/$env_name); building it says why:" >&2
  PYTHONPATH=$WORKSPACE_ROOT/third_party "$DEV_PYTHON" "$WORKSPACE_ROOT/tools/envs/build_env.py" "$env_name" >&2 || true
  exit 1
fi
pythonpath=
for dir in ${import_dirs//,/ }; do
  pythonpath=${pythonpath:+$pythonpath:}$runfiles/trainer_helpers/$dir
done
export PYTHONPATH=$pythonpath${PYTHONPATH:+:$PYTHONPATH}
export ENV_SERVER_PYTHON=$DEV_PYTHON
exec "$python" "$@"
