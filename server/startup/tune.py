"""`llamaserve tune`: the start-up measurements (weight format, int4 kernel per layer
shape, output projection, threads for one-token steps, the step's token budget) taken
again for a model and stored (model/plan/tuning.py), as `serve` would take them on a quiet
machine; the next `serve` of the same model, flags and thread count reads them back.
"""

from __future__ import annotations

import argparse

from model.plan import tuning
from scheduler import EngineConfig, create_engine
from server.startup.config import ServeConfig
from server.startup.flags import model_settings
from server.startup.launch import load


def tune(args: argparse.Namespace) -> int:
    tuning.retune()
    config = ServeConfig(
        **model_settings(args), engine=EngineConfig(max_model_len=args.max_model_len)
    )
    with tuning.startup():
        loaded = load(config)
        create_engine(loaded.model, loaded.tokenizer, config.engine)
    path = tuning.store_path()
    where = f"stored in {path}" if path is not None else "not stored (LLAMASERVE_TUNING_STORE=off)"
    print(f"llamaserve: start-up measurements for {loaded.name} taken again, {where}")
    return 0
