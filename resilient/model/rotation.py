"""Which checkpoints to delete after a commit. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from resilient.model.policies import CheckpointInfo, KeepPolicyLike

__all__ = ["RotationPlan", "plan_rotation"]


@dataclass(frozen=True, slots=True)
class RotationPlan:
    """Steps to keep and steps to delete; ``keep`` always holds the newest valid step."""

    keep: frozenset[int]
    delete: frozenset[int]


def plan_rotation(valid: Sequence[CheckpointInfo], keep: KeepPolicyLike | None) -> RotationPlan:
    """Apply ``keep`` to the valid committed checkpoints; never delete the newest one.

    Args:
        valid: the checkpoints that passed validation (only these are candidates).
        keep: the keep policy; ``None`` keeps everything.
    """
    steps = frozenset(i.step for i in valid)
    if keep is None or not steps:
        return RotationPlan(keep=steps, delete=frozenset())
    kept = (frozenset(keep(valid)) & steps) | {max(steps)}
    return RotationPlan(keep=kept, delete=steps - kept)
