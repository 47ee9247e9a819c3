"""The OpenAI-compatible HTTP server (`python -m luceio.serve`, `luceio serve`).

Nothing here is imported by `import luceio`: the server's dependencies (starlette, uvicorn,
sse-starlette, prometheus_client) stay optional for the engine. `args` and `protocol` import none
of them; `app` and `metrics` do."""
