"""Captioning a dataset with a local vision-language model or an ONNX tagger (`difftune caption`).

`detect` finds what kind of captioner a folder holds, `vlm` and `tagger` load and run the two
kinds, `styles` turns a style into a prompt and a model's answer into a caption line, and `run`
walks the images, writing each caption file atomically as soon as its batch is done.
"""
