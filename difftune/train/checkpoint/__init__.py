"""Resume checkpoints and LoRA files: one manager (`CheckpointManager`) saves, finds, loads,
checks and prunes them; see `manager.py` (the manager), `files.py` (the folder on disk),
`identity.py` (what a resume must match), `check.py` (a damaged folder refused) and `lora.py`
(the LoRA files)."""

from difftune.train.checkpoint.files import Checkpoint
from difftune.train.checkpoint.manager import CheckpointManager

__all__ = ["Checkpoint", "CheckpointManager"]
