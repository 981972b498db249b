"""The third_party pin tool: a pin comes from a named git directory, exactly at its commit, or fails saying how."""

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


def _pin(monkeypatch: pytest.MonkeyPatch, commit: str) -> None:
    monkeypatch.setitem(pins.PINS, "demo", {"url": "https://example.invalid/demo.git", "commit": commit})


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
