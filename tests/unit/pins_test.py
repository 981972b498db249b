"""The third_party pin tool: a pin comes from a named git directory, exactly at its commit, or fails saying how; and
what ./bazelw runs, which clones a missing pin when git reaches its URL, and otherwise says how to provide it."""

import subprocess
from pathlib import Path

import pins
import pytest


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def upstream(tmp_path: Path) -> tuple[Path, str, str]:
    """A small upstream repository with two commits; returns it, the older commit and the newer one."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    _git("init", "--quiet", cwd=repo)
    for text in ("first", "second"):
        (repo / "version.txt").write_text(text)
        _git("add", "version.txt", cwd=repo)
        _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", text, cwd=repo)
    return repo, _git("rev-parse", "HEAD~1", cwd=repo), _git("rev-parse", "HEAD", cwd=repo)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRAINER_HELPERS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _pin(monkeypatch: pytest.MonkeyPatch, commit: str, url: str = "https://example.invalid/demo.git") -> None:
    monkeypatch.setitem(pins.PINS, "demo", {"url": url, "commit": commit})


def test_a_missing_pin_says_how_to_provide_it(cache, capsys):
    assert pins.main(["path", "slime"]) == 1
    message = capsys.readouterr().err
    assert "slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515" in message
    assert "python third_party/pins.py fetch slime --from DIR" in message
    assert "https://github.com/THUDM/slime.git" in message


def test_a_pin_comes_from_a_checkout_at_exactly_its_commit(cache, upstream, monkeypatch):
    repo, older, _ = upstream
    _pin(monkeypatch, older)
    tree = pins.fetch("demo", repo)
    assert (tree / "version.txt").read_text() == "first"
    assert pins.path_of("demo") == tree
    assert cache in tree.parents


def test_a_pin_comes_from_a_bare_git_directory(cache, upstream, monkeypatch, tmp_path):
    repo, _, newer = upstream
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "--quiet", "--bare", str(repo), str(bare)], check=True)
    _pin(monkeypatch, newer)
    assert (pins.fetch("demo", bare) / "version.txt").read_text() == "second"


def test_a_source_without_the_commit_fails_and_leaves_nothing(cache, upstream, monkeypatch):
    repo, _, _ = upstream
    _pin(monkeypatch, "0" * 40)
    with pytest.raises(pins.PinUnavailable):
        pins.fetch("demo", repo)
    with pytest.raises(pins.PinUnavailable, match="--from DIR"):
        pins.path_of("demo")
    assert [p.name for p in (cache / "third_party").iterdir()] == []


def test_a_folder_that_is_no_git_repository_is_refused(cache, monkeypatch, tmp_path):
    _pin(monkeypatch, "0" * 40)
    with pytest.raises(pins.PinUnavailable, match="neither a git checkout nor a git directory"):
        pins.fetch("demo", tmp_path)


def test_a_missing_pin_is_cloned_when_git_reaches_its_url(cache, upstream, monkeypatch):
    repo, older, _ = upstream
    _pin(monkeypatch, older, url=str(repo))
    tree = pins.ensure("demo")
    assert (tree / "version.txt").read_text() == "first"
    assert pins.path_of("demo") == tree


def test_a_pin_in_the_cache_is_used_without_asking_its_url(cache, upstream, monkeypatch, tmp_path):
    repo, older, _ = upstream
    _pin(monkeypatch, older)
    tree = pins.fetch("demo", repo)
    _pin(monkeypatch, older, url=str(tmp_path / "gone.git"))
    assert pins.ensure("demo") == tree


def test_a_pin_git_cant_reach_says_how_to_provide_it(cache, monkeypatch, tmp_path, capsys):
    nowhere = str(tmp_path / "nowhere.git")
    monkeypatch.setattr(pins, "PINS", {"demo": {"url": nowhere, "commit": "0" * 40}})
    assert pins.main(["ensure"]) == 1
    message = capsys.readouterr().err
    assert f"git can't reach {nowhere}" in message
    assert "python third_party/pins.py fetch demo --from DIR" in message
    assert not (cache / "third_party").exists()


def test_a_reachable_url_without_the_commit_says_how_to_provide_it(cache, upstream, monkeypatch):
    repo, _, _ = upstream
    _pin(monkeypatch, "0" * 40, url=str(repo))
    with pytest.raises(pins.PinUnavailable, match="fetch demo --from DIR"):
        pins.ensure("demo")
    assert [p.name for p in (cache / "third_party").iterdir()] == []
