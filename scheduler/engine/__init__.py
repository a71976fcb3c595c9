"""The engine: `Engine` (one step: schedule, run, update, detokenise), its asyncio bridge
(`AsyncEngine`), the engine of an embedding model (`PoolingEngine`) and `create_engine`,
which wires one for a loaded model."""
