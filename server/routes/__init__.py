"""The OpenAI routes and their protocol: the pydantic models of the wire format, the
routers that put each endpoint on its path and the guards in front of them, each
endpoint's handler (completions, chat, responses, the router-facing endpoints), and the
translation of a request into engine inputs and of engine outputs into answers and SSE
streams. Handlers never touch KV blocks or model tensors."""
