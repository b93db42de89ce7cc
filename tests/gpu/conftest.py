"""GPU tests reuse the end-to-end fixtures (bundled images)."""

from tests.e2e.conftest import images, prompts  # noqa: F401
