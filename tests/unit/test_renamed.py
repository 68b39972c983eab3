"""The checkpoint directory is ``checkpoint_dir`` in every public callable; the old keywords
(``root``, ``ckpt_dir``) still work, each call warning once (``DeprecationWarning`` naming the new
keyword), and giving both is a ``TypeError``."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from resilient import CheckpointManager, Resume, Session, resumable
from resilient.errors import CheckpointNotFoundError
from resilient.export import export
from resilient.report import task_report
from resilient.workflow import cleanup, latest_checkpoint, stale_siblings


def _directory(kw: dict[str, Any]) -> Path:
    (value,) = [v for k, v in kw.items() if k in {"checkpoint_dir", "root", "ckpt_dir"}]
    return Path(value)


def _manager(**kw: Any) -> Path:
    with CheckpointManager(**kw) as mgr:
        assert mgr.root is not None
        return mgr.root


def _session(**kw: Any) -> Path:
    with Session(**kw, environ={}, exit_on_stop=False) as s:
        return s.root


def _resumable(**kw: Any) -> Path:
    seen: list[Path] = []

    @resumable(**kw, retries=0)
    def work(resume: Resume) -> None:
        root = resume.manager.root
        assert root is not None
        seen.append(root)

    work()
    return seen[0]


def _export(**kw: Any) -> Path:
    directory = _directory(kw)
    with pytest.raises(CheckpointNotFoundError, match="no valid checkpoint in"):
        export(**kw, out=directory / "out.h5")
    return directory


def _report(**kw: Any) -> Path:
    return Path(task_report(**kw).root)


def _latest(**kw: Any) -> Path:
    directory = _directory(kw)
    assert latest_checkpoint(**kw) is None
    return directory


def _siblings(**kw: Any) -> Path:
    directory = _directory(kw)
    assert stale_siblings(**kw) == []
    return directory


def _cleanup(**kw: Any) -> Path:
    directory = _directory(kw)
    assert cleanup(**kw, output_paths=[directory / "missing"]) == []
    return directory


CASES: list[tuple[str, Callable[..., Path], Callable[..., Any], str]] = [
    ("CheckpointManager", _manager, CheckpointManager, "root"),
    ("Session", _session, Session, "ckpt_dir"),
    ("resumable", _resumable, resumable, "ckpt_dir"),
    ("export", _export, export, "root"),
    ("task_report", _report, task_report, "root"),
    ("latest_checkpoint", _latest, latest_checkpoint, "ckpt_dir"),
    ("stale_siblings", _siblings, stale_siblings, "ckpt_dir"),
    ("cleanup", _cleanup, cleanup, "ckpt_dir"),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize(("name", "call", "target", "old"), CASES, ids=IDS)
def test_the_signature_names_checkpoint_dir_first(
    name: str, call: Callable[..., Path], target: Callable[..., Any], old: str
) -> None:
    params = list(inspect.signature(target).parameters)
    assert params[0] == "checkpoint_dir", name
    assert old not in params


@pytest.mark.parametrize(("name", "call", "target", "old"), CASES, ids=IDS)
def test_the_new_keyword_and_positional_use_do_not_warn(
    name: str, call: Callable[..., Path], target: Callable[..., Any], old: str, tmp_path: Path
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert call(checkpoint_dir=tmp_path / "ck") == tmp_path / "ck"
    if name == "CheckpointManager":  # the first argument stays positional
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            with CheckpointManager(tmp_path / "pos") as mgr:
                assert mgr.root == tmp_path / "pos"


@pytest.mark.parametrize(("name", "call", "target", "old"), CASES, ids=IDS)
def test_the_old_keyword_works_and_warns_once_per_call(
    name: str, call: Callable[..., Path], target: Callable[..., Any], old: str, tmp_path: Path
) -> None:
    for n in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert call(**{old: tmp_path / f"ck{n}"}) == tmp_path / f"ck{n}"
        deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert len(deprecations) == 1, [str(w.message) for w in deprecations]
        (w,) = deprecations
        assert str(w.message) == (
            f"keyword {old!r} of {name}() is deprecated; use 'checkpoint_dir' (the same value)"
        )
        assert w.filename == __file__  # points at the caller's line


@pytest.mark.parametrize(("name", "call", "target", "old"), CASES, ids=IDS)
def test_both_keywords_is_a_type_error(
    name: str, call: Callable[..., Path], target: Callable[..., Any], old: str, tmp_path: Path
) -> None:
    with pytest.raises(TypeError, match=f"got both 'checkpoint_dir' and '{old}'"):
        target(**{"checkpoint_dir": tmp_path / "a", old: tmp_path / "b"})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_positional_directory_and_the_old_keyword_is_a_type_error(tmp_path: Path) -> None:
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(TypeError, match="multiple values for argument 'checkpoint_dir'"),
    ):
        CheckpointManager(tmp_path / "a", root=tmp_path / "b")  # type: ignore[call-arg]
