"""Materialise the pinned upstream checkouts (slime, Megatron-LM, Miles) into a cache outside the repository.

Upstream code is never committed here. Each pin in ``pins.json`` names a public URL and a full commit; this tool
puts a work tree of exactly that commit under ``$TRAINER_HELPERS_CACHE`` (default
``${XDG_CACHE_HOME:-~/.cache}/trainer-helpers``), taking it from a checkout or git directory the user names, or
else cloning the public URL. ``path`` prints where a pin lives and fails, saying how to provide it, when it is
not there yet; the slime and Miles tiers rely on that message. ``ensure``, which ``./bazelw`` runs, clones each pin
missing from the cache whose URL git can reach, and says how to provide the others.

    python third_party/pins.py fetch slime [--from DIR]   # DIR: a checkout or a bare/git directory
    python third_party/pins.py fetch --all                # every pin, from each upstream URL
    python third_party/pins.py ensure                     # every pin missing from the cache, where git reaches it
    python third_party/pins.py path slime
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PINS = json.loads((Path(__file__).resolve().parent / "pins.json").read_text())
# How long git may take to answer whether a pin's URL is there. A clone can't be bounded so tightly (Megatron-LM's
# takes minutes), and an unbounded one would hang every ./bazelw on a machine whose network drops the packets.
REACH_TIMEOUT_S = 10


class PinUnavailable(Exception):
    """A pin is not in the cache and could not be obtained; the message says how to provide it."""


def cache_root() -> Path:
    """The folder holding every materialised pin, outside any checkout."""
    explicit = os.environ.get("TRAINER_HELPERS_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "trainer-helpers"


def pin_dir(name: str) -> Path:
    """Where pin ``name`` lives once materialised: one folder per commit, so a new pin never reuses an old tree."""
    return cache_root() / "third_party" / f"{name}-{PINS[name]['commit'][:12]}"


def how_to_provide(name: str) -> str:
    """The instructions printed whenever pin ``name`` is missing."""
    pin = PINS[name]
    return (
        f"{name} at {pin['commit']} is not in {pin_dir(name)}.\n"
        f"Provide it with one of:\n"
        f"  python third_party/pins.py fetch {name}                 # clones {pin['url']} (needs network)\n"
        f"  python third_party/pins.py fetch {name} --from DIR      # DIR: a checkout or git directory holding "
        f"that commit"
    )


def path_of(name: str) -> Path:
    """The work tree of pin ``name``. Raises PinUnavailable, with how to provide it, when it is not there."""
    if name not in PINS:
        raise PinUnavailable(f"no pin named {name!r}; pins are {', '.join(sorted(PINS))}")
    tree = pin_dir(name)
    if not (tree / ".pin-complete").is_file():
        raise PinUnavailable(how_to_provide(name))
    return tree


def _git(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PinUnavailable(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _source_git_dir(source: Path) -> Path:
    """The git directory of a checkout (``DIR/.git``) or of a bare or git directory given directly."""
    if (source / ".git").exists():
        return source / ".git"
    if (source / "objects").is_dir() and (source / "HEAD").is_file():
        return source
    raise PinUnavailable(f"{source} is neither a git checkout nor a git directory")


def fetch(name: str, source: Path | None) -> Path:
    """Put pin ``name`` into the cache from ``source`` (a checkout or git directory) or else its upstream URL.

    A pin already in the cache is kept as it is. The tree is built in a temporary folder beside its final place
    and moved there only once it holds exactly the pinned commit, so an interrupted fetch leaves nothing behind.
    Raises PinUnavailable when the source lacks the commit or the clone fails.
    """
    commit = PINS[name]["commit"]
    tree = pin_dir(name)
    if (tree / ".pin-complete").is_file():
        return tree
    tree.parent.mkdir(parents=True, exist_ok=True)
    origin = str(_source_git_dir(source.resolve())) if source else PINS[name]["url"]
    with tempfile.TemporaryDirectory(dir=tree.parent, prefix=f".{name}-") as scratch:
        work = Path(scratch) / "tree"
        print(f"pins: cloning {name} from {origin}", file=sys.stderr)
        clone = ["clone", "--quiet", "--no-checkout", origin, str(work)]
        if source is None:
            clone[1:1] = ["--filter=blob:none"]
        _git(*clone)
        _git("-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit, cwd=work)
        if _git("rev-parse", "HEAD", cwd=work) != commit:
            raise PinUnavailable(f"{origin} did not give {name} at {commit}")
        (work / ".pin-complete").write_text(commit + "\n")
        shutil.rmtree(tree, ignore_errors=True)
        work.rename(tree)
    return tree


def reachable(url: str) -> bool:
    """Whether git answers at ``url`` within REACH_TIMEOUT_S, never stopping to ask for credentials."""
    try:
        done = subprocess.run(
            ["git", "ls-remote", "--quiet", url, "HEAD"],
            capture_output=True,
            timeout=REACH_TIMEOUT_S,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def ensure(name: str) -> Path:
    """The work tree of pin ``name``: the one in the cache, with no network call, or else a clone of its upstream
    URL. Raises PinUnavailable, saying how to provide it, when git can't reach the URL or the clone fails."""
    tree = pin_dir(name)
    if (tree / ".pin-complete").is_file():
        return tree
    url = PINS[name]["url"]
    if not reachable(url):
        raise PinUnavailable(f"git can't reach {url} from this machine.\n{how_to_provide(name)}")
    try:
        return fetch(name, None)
    except PinUnavailable as failed:
        raise PinUnavailable(f"{failed}\n{how_to_provide(name)}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    fetch_verb = verbs.add_parser("fetch", help="materialise a pin into the cache")
    fetch_verb.add_argument("name", nargs="?", choices=sorted(PINS))
    fetch_verb.add_argument("--all", action="store_true", help="every pin, from its upstream URL")
    fetch_verb.add_argument("--from", dest="source", type=Path, help="a checkout or git directory to take it from")
    verbs.add_parser(
        "ensure", help="clone each pin missing from the cache when git can reach its URL; say how to provide the others"
    )
    path_verb = verbs.add_parser("path", help="print where a pin lives; fail with instructions if it is missing")
    path_verb.add_argument("name")
    args = parser.parse_args(argv)
    if args.verb == "ensure":
        return _ensure_all()
    try:
        if args.verb == "path":
            print(path_of(args.name))
        elif args.all:
            for name in sorted(PINS):
                print(fetch(name, None))
        elif args.name:
            print(fetch(args.name, args.source))
        else:
            parser.error("name a pin, or pass --all")
    except PinUnavailable as missing:
        print(f"pins: {missing}", file=sys.stderr)
        return 1
    return 0


def _ensure_all() -> int:
    """Every pin ensured, and how to provide each one still missing said on stderr; 1 when any is."""
    missing = 0
    for name in sorted(PINS):
        try:
            ensure(name)
        except PinUnavailable as unavailable:
            print(f"pins: {unavailable}", file=sys.stderr)
            missing += 1
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
