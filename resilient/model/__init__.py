"""The pure model: what a checkpoint is on disk and what a state is in memory. No I/O.

Owns:
    the on-disk format: :mod:`.filenames` (every file and directory name), :mod:`.schema` (the
    strict reader of typed mappings), :mod:`.manifest` (the manifest's values), :mod:`.codec`
    (its JSON per schema version, parsed strictly, and written), :mod:`.entries` (a rank's
    entry in that JSON), :mod:`.shards` (the shards of a sharded manifest), :mod:`.tiling`
    (segments that tile each file, blocks that tile each array, a file's checksum text),
    :mod:`.layout` (how ranks are grouped into files),
    :mod:`.checksum` (xxh3 digests), :mod:`.h5format` (a data file's HDF5 metadata, computed
    without HDF5);
    the state: :mod:`.tree` (nested states as named leaves), :mod:`.arrays` (array leaves as
    numpy and back), :mod:`.blocks` (blocks of global arrays, replicated values),
    :mod:`.dtensors` (DTensor leaves as blocks of their global tensors),
    :mod:`.payload` (what ``save()`` is handed, checked and split), :mod:`.rngstate` (the
    random streams a training draws from, as arrays);
    the decisions: :mod:`.policies` (when to save, what to keep), :mod:`.rotation` (which
    checkpoints to delete), :mod:`.xorcode` (which nodes share an XOR parity, and where each
    byte goes);
    :mod:`.torchlazy` (torch, reached lazily: the one way to it).

May import: :mod:`resilient.errors` and third-party libraries (numpy, xxhash; torch lazily, in
:mod:`.torchlazy` only). Nothing here reads or writes a file, talks to another rank, starts a
thread or reads the environment (tests/unit/test_layers.py checks the last two).
"""
