"""The ASGI app: OpenAI routes, session routes, SSE, and the one place errors become HTTP."""
