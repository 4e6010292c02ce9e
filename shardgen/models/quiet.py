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
    import logging

    for name in ("botocore", "aiobotocore", "s3fs", "fsspec"):  # object storage (output_uri, a prompts URL): one
        logging.getLogger(name).setLevel(logging.WARNING)       # INFO line per client created; retries are ours
