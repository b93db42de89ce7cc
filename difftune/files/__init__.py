"""The files difftune reads and writes: which it will read (safetensors, never pickle), the
names it gives them, and whether the disk has room for them."""
