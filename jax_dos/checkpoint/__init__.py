"""Orbax checkpoints of the parameters and the interleaved Adam state, wherever its parts are placed.

The modules, each importing only those above it in this list and ``jax_dos``'s own modules below the package:

- ``processes``: process 0's value, any process's flag, a barrier (the few things several processes agree on);
- ``template``: the restore template's tree check, zero-size leaves, Orbax's restore arguments;
- ``integrity``: manifests (checksums written last, verified before a restore) and damaged steps set aside;
- ``moments``: the moments' stored format and its conversion on restore;
- ``optax_state``: the state as optax's ``adamw`` state and back (``from_optax_adamw_state``, ``split_adam``);
- ``canonical``: the on-disk form a save writes and the template a restore reads into;
- ``reading``: a verified step read into the caller's templates (the moments converted where their format differs);
- ``host_copy``: host-resident arrays guarded (copied, or saved synchronously) while Orbax writes them;
- ``manager``: ``CheckpointManager`` (``docs/checkpoints.md``).
"""

from jax_dos.checkpoint.integrity import DAMAGED_DIR
from jax_dos.checkpoint.manager import (
  FORMAT,
  MANIFEST,
  CheckpointManager,
  DamagedCheckpointWarning,
  TemplateMismatchError,
)
from jax_dos.checkpoint.optax_state import from_optax_adamw_state, to_optax_adamw_state

__all__ = [
  "DAMAGED_DIR",
  "FORMAT",
  "MANIFEST",
  "CheckpointManager",
  "DamagedCheckpointWarning",
  "TemplateMismatchError",
  "from_optax_adamw_state",
  "to_optax_adamw_state",
]
