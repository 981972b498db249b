"""The replicas as the trainer's pool will see them, asked from this process over their Task API: each answers, and
each serves the same env with the same task ids per split, the check the pool makes at its first episode, made
here before anything trains."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

_REQUEST_S = 30.0
_RETRY_S = 0.25
# The replicas are the cluster's own addresses: asked directly, as chat_core asks them, whatever proxy is set.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Catalogue:
    """What a server serves: its env's name and its task ids, by split in the server's order."""

    env: str
    tasks: dict[str, tuple[str, ...]]


def wait_until_serving(url: str, timeout_s: float) -> None:
    """Return once ``url``'s Task API lists its env. Raises TimeoutError saying what the last try got when
    ``timeout_s`` seconds pass first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _get(url, "/list_environments")
            return
        except (OSError, ValueError) as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} didn't answer from here within {timeout_s:g} s: {e}") from None
        time.sleep(_RETRY_S)


def catalogue(url: str) -> Catalogue:
    """The env and task ids ``url`` serves. Raises OSError when it can't be asked, ValueError when an answer isn't
    the Task API's."""
    names = _get(url, "/list_environments")
    if not (isinstance(names, list) and len(names) == 1 and isinstance(names[0], str)):
        raise ValueError(f"{url} lists {names!r} as its environments, not one env name")
    env = names[0]
    try:
        splits = [split["name"] for split in _get(url, f"/{env}/splits")]
        tasks = {split: _task_ids(_post(url, f"/{env}/tasks", {"split": split})) for split in splits}
    except (KeyError, TypeError) as e:
        raise ValueError(f"{url} answered its Task API with something else ({type(e).__name__}: {e})") from None
    return Catalogue(env, tasks)


def difference(catalogue: Catalogue, reference: Catalogue, reference_url: str) -> str | None:
    """How ``catalogue`` differs from ``reference``, served at ``reference_url``: the first difference in words, or
    None when they are the same."""
    if catalogue.env != reference.env:
        return f"env {catalogue.env!r}, but {reference_url} serves env {reference.env!r}"
    if list(catalogue.tasks) != list(reference.tasks):
        return f"the splits {list(catalogue.tasks)}, but {reference_url} serves {list(reference.tasks)}"
    for split, ids in catalogue.tasks.items():
        for index, (here, there) in enumerate(zip(ids, reference.tasks[split], strict=False)):
            if here != there:
                return f"{here!r} as task #{index} of split {split!r}, but {reference_url} serves {there!r}"
        if len(ids) != len(reference.tasks[split]):
            return f"{len(ids)} tasks in split {split!r}, but {reference_url} serves {len(reference.tasks[split])}"
    return None


def _task_ids(listed: Any) -> tuple[str, ...]:
    return tuple(task["id"] for task in listed["tasks"])


def _get(url: str, path: str) -> Any:
    with _DIRECT.open(url + path, timeout=_REQUEST_S) as answer:
        return json.load(answer)


def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with _DIRECT.open(request, timeout=_REQUEST_S) as answer:
        return json.load(answer)
