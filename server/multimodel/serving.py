"""`llamaserve serve` with several models: the catalog and the pool built from the flags,
every model's command line checked before anything starts (a wrong flag in the config
file stops the start-up with one sentence naming the model, not the model's first
request), and the front run under uvicorn as a single-model server is run.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

from server.multimodel.catalog import Catalog, build_catalog
from server.multimodel.front import build_front
from server.multimodel.memory import available_bytes
from server.multimodel.pool import ModelPool, PoolSettings
from server.startup.config import ServeConfig
from server.startup.flags import UsageError
from server.startup.multimodel_flags import inherited_flags
from server.startup.serve_flags import listener_settings

logger = logging.getLogger("llamaserve.models")


def check_model_flags(
    catalog: Catalog, shared: Sequence[str], parser_factory: Callable[[], argparse.ArgumentParser]
) -> None:
    for spec in catalog.models.values():
        parser = parser_factory()

        def refuse(message: str, name: str = spec.name) -> None:
            raise UsageError(f"model {name}: {message}")

        parser.error = refuse  # type: ignore[method-assign]
        parser.parse_args([spec.source, *shared, *spec.flags])


def serve_models(
    args: argparse.Namespace,
    argv: Sequence[str],
    api_keys: list[str],
    parser_factory: Callable[[], argparse.ArgumentParser],
) -> int:
    """`argv`: serve's own words; `parser_factory` builds serve's parser afresh."""
    from server.startup.launch import uvicorn_server

    if args.models_max is not None and args.models_max < 1:
        raise UsageError(f"--models-max must be at least 1, got {args.models_max}")
    models = ([args.model_path] if args.model_path else []) + list(args.model or [])
    catalog = build_catalog(models, args.models_dir, args.models_config, args.load_at_start)
    shared = inherited_flags(argv, parser_factory())
    check_model_flags(catalog, shared, parser_factory)
    budget = args.models_memory or available_bytes()
    settings = PoolSettings(
        shared_flags=shared,
        max_models=args.models_max,
        memory_budget_bytes=budget,
        idle_unload_s=args.idle_unload_s,
        load_timeout_s=args.models_load_timeout,
        stop_grace_s=args.shutdown_grace,
    )
    pool = ModelPool(list(catalog.models.values()), settings)
    app = build_front(
        pool, api_keys, args.max_request_bytes, args.metrics_require_api_key, args.allowed_origins
    )
    logger.info(
        "serving %d models (%s) at http://%s:%d/v1; memory budget %.2f GiB",
        len(catalog.models),
        ", ".join(catalog.models),
        args.host,
        args.port,
        budget / 2**30,
    )
    config = ServeConfig(**listener_settings(args))
    uvicorn_server(app, config).run()
    return 0
