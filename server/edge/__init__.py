"""The HTTP edge: what every request passes through whatever its route: OpenAI-shaped
errors, request ids and access logs, the body-size bound, what one connection may cost,
and the Prometheus metrics of the instance."""
