"""A Qwen-VL processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) over an image processor and a
tokenizer only.

transformers' Qwen-VL processors also hold a video processor, whose class needs torchvision
and which transformers checks even when it is absent; images and text need neither, so this
subclass passes None for it. Used by the Qwen-Image edit pipelines and by captioning.
"""

from __future__ import annotations

from typing import Any


def without_video(base: type, image_processor: Any, tokenizer: Any,
                  chat_template: str | None = None) -> Any:
    """An instance of a subclass of the Qwen-VL processor class `base`, named as `base` (saved
    folders name transformers' class, which reads them back wherever it can load), over
    `image_processor` and `tokenizer` with no video processor."""

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: Any = None, **kwargs: Any) -> None:
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template,
                      **kwargs)

    cls = type(base.__name__, (base,), {"__init__": __init__, "__module__": "transformers",
                                        "__doc__": f"{base.__name__} without video."})
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)
