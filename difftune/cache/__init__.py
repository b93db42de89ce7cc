"""Content-addressed caches for latents and text-encoder outputs."""

from difftune.cache.keys import entry_key, latent_fields, text_fields
from difftune.cache.store import MemoryStore, NullStore, Store, make_store

__all__ = ["MemoryStore", "NullStore", "Store", "entry_key", "latent_fields", "make_store",
           "text_fields"]
