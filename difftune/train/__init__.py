"""The training recipe: objective, optimizer, loop, checkpoints."""
