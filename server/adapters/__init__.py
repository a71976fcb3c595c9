"""LoRA adapters as the API sees them: the names a request's `model` may give, each with
the path it is read from (`AdapterRegistry`)."""
