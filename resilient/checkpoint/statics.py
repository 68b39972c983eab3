"""Static data (mesh, coefficients): content-addressed, written once, reference-counted, collected.

``ROOT/static/<hash>/`` holds one committed set per content (a set of the root's ``static``
child target, :func:`resilient.io.checkpoints.statics_of`, by name); checkpoints refer to it by hash in
their manifest. ``ROOT/static/<hash>.copy/`` is its second copy: the same manifest, shards and
``COMMITTED`` always, the data files too unless ``static_copies=1`` (large meshes). One damaged
copy is repaired from the other (:func:`resilient.io.repair.repair_static`). A save of
unchanged static data writes nothing; both copies are deleted once no checkpoint (valid,
invalid or quarantined) refers to them.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence

from resilient._version import __version__
from resilient.checkpoint.saveset import save_set
from resilient.errors import ConfigError, StaticDataError
from resilient.io.checkpoints import statics_of
from resilient.io.commit import PendingDir
from resilient.io.repair import add_second_copy, repair_static
from resilient.io.storage import Trash
from resilient.io.targets import DirectoryTarget, Target
from resilient.model import filenames
from resilient.model.checksum import hash128
from resilient.model.payload import LocalData
from resilient.parallel.collective import Collective
from resilient.parallel.setcomms import SetComms

__all__ = ["StaticStore", "check_static_copies"]

log = logging.getLogger(__name__)


def check_static_copies(copies: object) -> int:
    """``copies`` as a number of copies of the static data's files (1 or 2).

    Raises:
        ConfigError: anything else.
    """
    if copies not in (1, 2) or isinstance(copies, bool) or not isinstance(copies, int):
        raise ConfigError(
            f"static_copies must be 1 or 2 (copies of the static data's files; its manifest "
            f"always has two), got {copies!r}"
        )
    return copies


class StaticStore:
    """The static data of one checkpoint root (``root``: its target).

    :meth:`write` is collective, :meth:`is_stored` the coordinator's (a save asks it when
    the content is not what its previous save kept); the reference counts and :meth:`collect`
    are the coordinator's (filled by :class:`resilient.checkpoint.catalog.Catalog` from what it finds on disk).
    """

    def __init__(self, root: Target, *, copies: int = 2) -> None:
        self.copies = check_static_copies(copies)
        self.target = statics_of(root)
        self._refs: Counter[str] = Counter()
        self._pinned = False  # a reference could not be read: collect nothing
        self._known_good: set[str] = set()

    @staticmethod
    def describe(data: LocalData | None) -> object | None:
        """Local: what :meth:`content` needs of this rank's static data (``None``: none)."""
        return None if data is None else data.describe()

    @staticmethod
    def content(kind: str, descs: Sequence[object | None]) -> str | None:
        """Local: the content hash of every rank's static data (``descs``, by rank, from
        :meth:`describe`; every rank that has them computes the same), ``None`` if no rank
        gave any."""
        if all(d is None for d in descs):
            return None
        return hash128(json.dumps([kind, len(descs), descs], sort_keys=True))

    def write(self, comms: SetComms, step: int, data: LocalData | None, content: str) -> None:
        """Collective over ``comms.comm``: write every rank's static data as ``content`` (what
        :meth:`is_stored` found missing)."""
        coll = Collective(comms.comm)
        pending, copy = coll.broadcast(
            "creating temporary directories for static data",
            lambda: (
                self._create(filenames.static_dir_name(content)),
                self._create(filenames.static_copy_dir_name(content)),
            ),
        )
        save_set(
            comms, self.target, pending, step=step,
            data=data or LocalData({}, {}), kind="static", library_version=__version__,
            copy=copy, copies=self.copies,
        )  # fmt: skip
        self._known_good.add(content)

    def _create(self, name: str) -> PendingDir:
        """Coordinator: create the pending copy of the set ``name``."""
        pending = self.target.pending(name)
        self.target.create(pending)
        return pending

    def is_stored(self, content: str) -> bool:
        """Whether a valid copy of ``content`` exists (checked once per process; a damaged
        copy is repaired from the other: :func:`~resilient.io.repair.repair_static`)."""
        if content in self._known_good:
            return True
        names = (filenames.static_dir_name(content), filenames.static_copy_dir_name(content))
        if not set(names) & set(self.target.names()):
            return False  # new content
        try:
            source = repair_static(self.target, content)
        except StaticDataError as exc:
            log.warning(
                "static data %s has no intact copy (%s): writing it again", content, exc.reason
            )
            return False
        if self.copies == 2:  # a root from before the copies: its static data gets a second
            add_second_copy(source)
        self._known_good.add(content)
        return True

    # ------------------------------------------------------------------ reference counting

    def ref(self, content: str | None) -> None:
        """Count one more checkpoint referring to ``content``."""
        if content is not None:
            self._refs[content] += 1

    def unref(self, content: str | None) -> None:
        """Count one checkpoint fewer referring to ``content``."""
        if content is not None and self._refs[content] > 0:
            self._refs[content] -= 1

    def pin(self) -> None:
        """Some reference is unknown (an unreadable quarantined manifest): never collect."""
        self._pinned = True

    def collect(self) -> list[Trash]:
        """Trash every static data copy no checkpoint refers to; return the trash to delete.
        A directory's ``static/`` that is a symlink is never collected from (it may be shared)."""
        linked = isinstance(self.target, DirectoryTarget) and self.target.root.is_symlink()
        if self._pinned or linked:
            return []
        trash = []
        for name in sorted(self.target.names()):
            content = name if filenames.is_static_dir(name) else filenames.parse_static_copy(name)
            if content is not None and self._refs[content] <= 0:
                trash.append(self.target.trash(name, durable=False))
                self._known_good.discard(content)
                if content == name:
                    log.info("deleted unreferenced static data %s", name)
        return trash
