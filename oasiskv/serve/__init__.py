"""`oasiskv serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

protocol.py    request/response bodies (pydantic), refusal of what the engine cannot honour
errors.py      errors with their HTTP status and OpenAI's error object
async_engine.py  the engine's stepping loop in a thread, a queue per request (asyncio)
streaming.py   incremental detokenisation with stop-string hold-back, SSE framing
serving.py     /v1/completions and /v1/chat/completions: prompts -> requests -> responses
metrics.py     Prometheus metrics (oasiskv:...) in a per-server registry
middleware.py  X-Request-Id, API key, body size limit
app.py         the FastAPI app and its routes
server.py      the CLI subcommand and the uvicorn runner
"""
