"""Sampling during training: prompt files (`prompts`) read afresh at each event, and the
runner (`runner`) that makes images through the family's pipeline without stopping training."""
