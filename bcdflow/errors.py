"""The two error families of bcdflow. Every layer raises them; nothing else decides an exit status.

- :class:`BadInput`: the user asked for something invalid (a config key, a file, a run id, a device).
  The message is one line that names the key or file. The CLI exits 2; a task never retries it.
- :class:`DamagedArtifact`: something in the store is missing, truncated or fails its checksum (a block
  file, a manifest, state.json, a shard, a checkpoint). The message names the object and what to do.
  The CLI exits 1; a task never retries it (waiting cannot repair bytes).

This module imports nothing, so ``models/`` and ``storage/`` can derive their errors from it.
"""


class BadInput(ValueError):
    """Invalid user input; the message names the key or file (exit 2, never retried)."""


class DamagedArtifact(RuntimeError):
    """A stored object is missing or corrupt; the message names it (exit 1, never retried)."""
