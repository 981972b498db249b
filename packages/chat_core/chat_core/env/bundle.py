"""Whether env servers serve one bundle: the same env, with the same task ids at the same places of the same splits.
A pool checks each of its servers this way before its first episode there (``chat_core.env.pool``), and
``check_same_bundle`` checks a list of servers at once, for whoever starts them (``env_replicas``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from chat_core.env.task_api import OpenEnvServer
from chat_core.episode_ref import server_url
from chat_core.errors import OpenEnvError, ServerMismatch, ServerUnreachable

Catalogue = dict[str, tuple[str, ...]]
"""A server's task ids, by split, in index order."""


@dataclass(frozen=True)
class Served:
    """What the server at ``url`` serves: its env's name and its task ids by split."""

    url: str
    env_name: str
    catalogue: Catalogue

    def mismatch(self, reference: Served) -> ServerMismatch | None:
        """The ServerMismatch naming this server and the first thing it serves differently from ``reference``, or
        None when it serves the same env, splits and task ids."""
        if difference := _difference(self, reference):
            return ServerMismatch(
                f"{self.url} serves {difference}: every server of the pool must serve the same bundle"
            )
        return None


async def check_same_bundle(urls: Sequence[str]) -> None:
    """Check the servers at ``urls`` as a pool checks each before its first episode: every one serves the same env,
    with the same splits and the same task ids at the same places, as the first. Raises ServerMismatch naming a
    server and the first thing it serves differently from the first server, or why it can't serve a pool (it answers
    outside the Task API); ServerUnreachable when a server can't be reached, where a pool would rest it and ask
    again; InvalidServerUrl when a URL isn't an absolute http(s) URL. When several servers fail, the error is the
    first one's in ``urls``."""
    servers = [server_url(url) for url in urls]
    found = await asyncio.gather(*map(served_by, servers), return_exceptions=True)
    for each in found:
        if isinstance(each, BaseException):
            raise each
    for served in found[1:]:
        if mismatch := served.mismatch(found[0]):
            raise mismatch


async def served_by(url: str) -> Served:
    """What the server at ``url`` serves. Raises ServerUnreachable when it can't be reached, and ServerMismatch when
    it answers, but not as an OpenEnv server a pool can play on."""
    try:
        api = OpenEnvServer(url)
        name = await api.env_name()
        splits = await api.splits()
        tasks = await asyncio.gather(*map(api.tasks, splits))
    except ServerUnreachable:
        raise
    except OpenEnvError as e:
        raise ServerMismatch(f"{url} can't serve the pool: {e}") from None
    return Served(
        url, name, {split: tuple(task.id for task in listed) for split, listed in zip(splits, tasks, strict=True)}
    )


def _difference(served: Served, reference: Served) -> str | None:
    """The first thing ``served`` serves differently from ``reference``, in words, or None."""
    there = reference.url
    if served.env_name != reference.env_name:
        return f"env {served.env_name!r}, but {there} serves env {reference.env_name!r}"
    if list(served.catalogue) != list(reference.catalogue):
        return f"the splits {list(served.catalogue)}, but {there} serves {list(reference.catalogue)}"
    for split, ids in served.catalogue.items():
        theirs = reference.catalogue[split]
        if ids != theirs:
            for index, (mine, its) in enumerate(zip(ids, theirs, strict=False)):
                if mine != its:
                    return f"{mine!r} as task #{index} of split {split!r}, but {there} serves {its!r}"
            return f"{len(ids)} tasks in split {split!r}, but {there} serves {len(theirs)}"
    return None
