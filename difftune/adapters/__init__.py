"""Trainable adapters (LoRA) and their file formats."""
