"""Library chatter off: kept apart from loader.py so the tiny models' builders can use it without a circle."""


def quiet_libraries() -> None:
    """diffusers/transformers warn once per batch about prompts longer than the text encoder's
    window (truncation is expected in batch generation) and draw progress bars while building, saving and
    loading pipelines (the tiny model's first build among them); keep their errors only."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    quiet_storage_clients()


def quiet_storage_clients() -> None:
    """The object storage clients (a bucket run_dir, output_uri, a prompts URL) log an INFO line per client created
    and their own retries, which are shardgen's to report: their warnings and errors only."""
    import logging

    for name in ("botocore", "aiobotocore", "s3fs", "fsspec"):
        logging.getLogger(name).setLevel(logging.WARNING)
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _DroppedConnectionNoise) for f in asyncio_log.filters):
        asyncio_log.addFilter(_DroppedConnectionNoise())


class _DroppedConnectionNoise:
    """Drops asyncio's "Task exception was never retrieved" for a request aiohttp was writing when the storage
    dropped the connection: a traceback per request in flight, while the request itself fails and is retried
    (and reported once, in one line, when it keeps failing) by shardgen."""

    def filter(self, record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage().startswith("Task exception was never retrieved")
                    and type(exc).__module__.startswith("aiohttp"))
