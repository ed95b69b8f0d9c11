"""Values shared by the bottom layers, which may not import each other (docs/DESIGN.md §4)."""

IGNORE_INDEX = -100
"""The target of a masked position (a prompt token in the supervised formats): ``storage.tokens`` writes it,
the loss in ``models.base`` skips it. It is ``F.cross_entropy``'s default ``ignore_index``."""
