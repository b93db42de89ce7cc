"""The HTTP API under /api, one module per area, each with `router(ctx) -> APIRouter`.

The pages call the same functions the API routes call, so what a script sees is what a user
sees; FastAPI documents every route at /docs (OpenAPI JSON at /openapi.json).
"""
