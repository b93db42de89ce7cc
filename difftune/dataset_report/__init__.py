"""`difftune dataset report`: what in a dataset would spoil a LoRA, found before training.

`measure` decodes each image once (reduced, in threads) for its size, a perceptual hash and a
sharpness figure; `checks` turns measurements and caption files into findings; `render` writes
them as a terminal table, JSON, and the one-line summary `difftune check` prints. Nothing here
stops a run: it informs.
"""
