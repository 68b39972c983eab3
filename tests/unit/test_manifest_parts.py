"""A restore's parts of a manifest: each rank receives its own entry (its file group's, for the
group's leader), not every rank's (issue 23, point 4)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from resilient import CheckpointManager
from resilient.checkpoint.restorer import Candidate, _needed, as_received, rank_parts
from resilient.errors import CollectiveError
from resilient.io.targets import DirectoryTarget, SetRef
from resilient.model.codec import manifest_json
from resilient.model.layout import Layout
from resilient.model.manifest import Manifest, PartialRanks, RankEntry
from resilient.parallel.collective import Collective
from resilient.parallel.comm import SerialComm
from tests.unit.ckutil import assert_state_equal, state_of, static_of
from tests.unit.test_manifest import sample_manifest


def test_a_part_holds_the_entries_asked_for_and_their_files() -> None:
    m = sample_manifest()
    part = m.part((2,))
    assert part.is_part and not m.is_part
    assert len(part.ranks) == 3 and part.ranks[2] == m.ranks[2] and part.ranks[-1] == m.ranks[2]
    assert [f.name for f in part.files] == ["node_00001.h5"]
    assert (part.step, part.static, part.metrics, part.layout) == (
        m.step, m.static, m.metrics, m.layout,
    )  # fmt: skip
    with pytest.raises(LookupError, match="rank 0's entry is not in this part"):
        part.ranks[0]
    with pytest.raises(LookupError):
        list(part.ranks)
    with pytest.raises(ValueError, match="cannot be written"):
        manifest_json(part)


def test_parts_equal_part_and_pickle_only_their_entries() -> None:
    m = sample_manifest()
    parts = m.parts([(0, 1), (1,), (2,)])
    assert parts == [m.part((0, 1)), m.part((1,)), m.part((2,))]
    assert [[f.name for f in p.files] for p in parts] == [["node_00000.h5"]] * 2 + [
        ["node_00001.h5"]
    ]
    again = pickle.loads(pickle.dumps(parts[1]))
    assert again == parts[1] and again.ranks.held == (1,)
    # nothing per absent rank: a part of one rank of a huge manifest stays small
    big = PartialRanks(1 << 20, {5: m.ranks[0]})
    assert len(pickle.dumps(big)) < len(pickle.dumps(m.ranks[0])) + 200


def test_every_rank_gets_its_entry_and_a_leader_its_group() -> None:
    lay = Layout("node", 5, ((0, 1, 2), (3, 4)))
    assert _needed(lay, lay) == [(0, 1, 2), (1,), (2,), (3, 4), (4,)]
    other_groups = Layout("node", 5, ((0, 1), (2, 3, 4)))
    assert _needed(lay, other_groups) == [(0,), (1,), (2,), (3,), (4,)]
    assert _needed(lay, Layout("node", 2, ((0, 1),))) == [(), ()]  # elastic


def test_the_layout_travels_only_when_it_is_not_this_runs() -> None:
    m = sample_manifest()
    whole = Candidate(SetRef(DirectoryTarget(Path("/")), "x"), m, m)
    parts = rank_parts(whole, m.layout)
    assert all(p.manifest.layout.groups == () for p in parts)  # every rank knows them
    assert [as_received(p.manifest, m.layout) for p in parts] == m.parts([(0, 1), (1,), (2,)])
    assert [p.static.ranks.held for p in parts] == [(0,), (1,), (2,)]  # type: ignore[union-attr]
    custom = Layout("node", 3, ((0,), (1, 2)))
    moved = rank_parts(whole, custom)
    assert all(p.manifest.layout == m.layout for p in moved)
    assert [p.manifest.ranks.held for p in moved] == [(0,), (1,), (2,)]  # type: ignore[attr-defined]


def test_scatter_gives_the_value_or_raises_on_every_rank() -> None:
    coll = Collective(SerialComm())
    assert coll.scatter("giving", lambda: ["mine"]) == "mine"
    with pytest.raises(CollectiveError, match="2 values for 1 ranks"):
        coll.scatter("giving", lambda: ["a", "b"])


def _entries(m: Manifest) -> list[RankEntry]:
    return [m.ranks[r] for r in m.ranks.held]  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["self", "world"])
def test_a_restore_gets_a_part_and_is_bit_identical(tmp_path: Path, kind: str) -> None:
    with CheckpointManager(tmp_path, checkpoint_comm=kind) as m:
        m.save(1, state_of(1), static=static_of())
        m.save(2, state_of(2), static=static_of())
    with CheckpointManager(tmp_path, checkpoint_comm=kind) as m:
        step, state = m.restore()
        assert step == 2
        assert_state_equal(state, {**state_of(2), **static_of()})
        restored = m._restorer.last_restored
        assert restored is not None and restored[1].is_part
        assert restored[1].layout == m.layout and len(_entries(restored[1])) == 1
        m.save(3, state_of(3), static=static_of())  # reuses the restored part's skeleton
        step, state = m.restore(step=1)
        assert step == 1
        assert_state_equal(state, {**state_of(1), **static_of()})
    with CheckpointManager(tmp_path, checkpoint_comm=kind) as m:
        step, state = m.restore()
        assert step == 3
        assert_state_equal(state, {**state_of(3), **static_of()})
