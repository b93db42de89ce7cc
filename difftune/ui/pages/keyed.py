"""A container whose children follow a list that changes a little at a time.

The run page shows a long run's samples and files; rebuilding all of them whenever one is
added would send thousands of elements to the browser each time (and block the app while it
builds them). `Keyed` keeps one child per key: a new key gets a new child at its place, a key
whose signature changed is rebuilt, a key gone is removed, and the rest stay as they are.
"""

from __future__ import annotations

from typing import Callable, Hashable

from nicegui import ui


class Keyed:
    """The children of `container`, one per key, in the order of the last `sync`."""

    def __init__(self, container: ui.element) -> None:
        self.container = container
        self.shown: dict[Hashable, tuple[Hashable, ui.element]] = {}

    def sync(self, items: list[tuple[Hashable, Hashable]],
             build: Callable[[Hashable], ui.element]) -> None:
        """Show one child per (key, signature) of `items`, in that order; `build(key)`, called
        inside the container, makes the child of a key that is new or whose signature
        changed, and returns it."""
        wanted = dict(items)
        for key, (signature, element) in list(self.shown.items()):
            if wanted.get(key, object()) != signature:
                self.container.remove(element)
                del self.shown[key]
        for index, (key, signature) in enumerate(items):
            if key not in self.shown:
                with self.container:
                    self.shown[key] = (signature, build(key))
            element = self.shown[key][1]
            children = self.container.default_slot.children
            if index >= len(children) or children[index] is not element:
                element.move(target_index=index)
