"""The HTTP gateway: OpenAI- and Anthropic-compatible endpoints for coding agents, /health and /metrics.

A process of its own (`python -m stratad.gateway`, started by `stratad serve` when `http` is set) that holds no
model weights: it talks to the coordinator through `stratad.client.AsyncClient` like any client. Importing this
package is cheap (the web stack is imported by `app` only), so the daemon's config can use `launch`.
"""
