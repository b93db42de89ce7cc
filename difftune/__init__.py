"""difftune: fine-tune text-to-image diffusion models with LoRA."""

__version__ = "0.1.0"
