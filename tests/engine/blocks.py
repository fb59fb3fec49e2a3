"""Block accounting read through the engine's public load report."""


def all_blocks_free(engine) -> bool:
    r = engine.load_report()
    return r["free_kv_blocks"] == r["total_kv_blocks"]


def some_blocks_used(engine) -> bool:
    r = engine.load_report()
    return r["free_kv_blocks"] < r["total_kv_blocks"]
