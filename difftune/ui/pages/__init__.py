"""The app's pages, one module per page, each with `register(ctx)` defining its routes."""
