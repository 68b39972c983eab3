"""Partner copies: the ring of nodes and the settings that refuse a partner without a tier.

The copies themselves, their rebuild and their failures run with real ranks on several MPI
nodes in tests/test_multinode.py and on the local Slurm in tests/test_slurm_multinode.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient import CheckpointManager
from resilient.checkpoint.partner import Ring
from resilient.checkpoint.redundancy import check_redundancy, check_set_size
from resilient.config import CheckpointConfig
from resilient.errors import ConfigError


def test_the_ring_follows_the_first_rank_of_each_node() -> None:
    # ranks 0,3 on n1; 1,2 on n2; 4 on n3: the ring is n1 -> n2 -> n3 -> n1
    ring = Ring.of([(0, "n1"), (1, "n2"), (1, "n2"), (0, "n1"), (4, "n3")])
    assert ring.leaders == (0, 1, 4) and ring.labels == ("n1", "n2", "n3")
    assert ring.ranks == ((0, 3), (1, 2), (4,))
    assert [ring.right(n) for n in ring.leaders] == [1, 4, 0]
    assert [ring.left(n) for n in ring.leaders] == [4, 0, 1]
    assert ring.label(4) == "n3" and ring.ranks_of(1) == (1, 2)


def test_two_nodes_are_each_others_partner_and_one_node_has_none() -> None:
    two = Ring.of([(0, "a"), (1, "b")])
    assert two.right(0) == two.left(0) == 1
    one = Ring.of([(0, "a"), (0, "a")])
    assert len(one) == 1 and one.right(0) == 0


def test_unknown_schemes_are_refused() -> None:
    assert check_redundancy(None) is None and check_redundancy("partner") == "partner"
    assert check_redundancy("xor") == "xor" and check_set_size(3) == 3
    with pytest.raises(ConfigError, match="redundancy must be one of partner, xor"):
        check_redundancy("mirror")
    for bad in (2, 0, True, 8.0, "8"):
        with pytest.raises(ConfigError, match="xor_set_size must be an integer of at least 3"):
            check_set_size(bad)


def test_partner_without_a_local_tier_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs local_dir"):
        CheckpointManager(tmp_path / "ck", redundancy="partner")
    with pytest.raises(ConfigError, match="redundancy must be one of"):
        CheckpointManager(tmp_path / "ck", local_dir=tmp_path / "l", redundancy="mirror")


def test_yaml_redundancy_is_checked() -> None:
    cfg = CheckpointConfig.from_dict({"local_dir": "/dev/shm", "redundancy": "partner"})
    assert cfg.session_options()["redundancy"] == "partner"
    with pytest.raises(ConfigError, match="needs local_dir"):
        CheckpointConfig.from_dict({"redundancy": "partner"})
    with pytest.raises(ConfigError, match="redundancy: one of partner, xor"):
        CheckpointConfig.from_dict({"local_dir": "/dev/shm", "redundancy": "raid"})
    xor = CheckpointConfig.from_dict(
        {"local_dir": "/dev/shm", "redundancy": "xor", "xor_set_size": 4}
    )
    assert xor.session_options()["xor_set_size"] == 4
    with pytest.raises(ConfigError, match="xor_set_size must be an integer of at least 3"):
        CheckpointConfig.from_dict({"local_dir": "/dev/shm", "redundancy": "xor", "xor_set_size": 2})


def test_one_node_manager_with_partner_saves_and_restores(tmp_path: Path) -> None:
    import numpy as np

    with CheckpointManager(
        tmp_path / "ck", local_dir=tmp_path / "local", redundancy="partner"
    ) as m:
        m.save(1, {"u": np.arange(5.0)})
    with CheckpointManager(
        tmp_path / "ck", local_dir=tmp_path / "local", redundancy="partner"
    ) as m:
        step, state = m.restore()
    assert step == 1 and state["u"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
