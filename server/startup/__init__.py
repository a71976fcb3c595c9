"""Start-up: the `llamaserve` command line and its flags, the configuration they build
(config.py), launching a server from it under uvicorn, the tensor-parallel ranks, and
`generate`. Nothing here runs per request."""
