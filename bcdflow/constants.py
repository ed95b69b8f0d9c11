"""Values shared by the bottom layers, which may not import each other (docs/DESIGN.md §4)."""

IGNORE_INDEX = -100
"""The target of a masked position (a prompt token in the supervised formats): ``storage.tokens`` writes it,
the loss in ``models.base`` skips it. It is ``F.cross_entropy``'s default ``ignore_index``."""

MAX_LEASE_SECONDS = 86400.0
"""The longest a lease lives without renewal (``fleet.lease_seconds`` is refused above it): a ttl read from a stored
lease is trusted only up to this, so a damaged or hostile lease object cannot make an observer wait longer."""

MAX_MEMORY_GB = 1e6
"""The most memory, in GB, a card (``train.memory_gb``, ``--gpu-gb``) may be said to have: a petabyte, past any device
(the largest hold a few hundred GB). A finite size above it overflowed the planner's byte counts to a traceback."""
