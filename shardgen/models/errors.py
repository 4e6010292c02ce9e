"""The models room's error: what loading a model raises when the configuration cannot work (its own module so the
tiny builders, the dummy builder and the loader can all raise it without importing each other)."""

from __future__ import annotations

from shardgen.errors import UserError


class ModelLoadError(UserError, RuntimeError):
    """The model cannot be loaded as configured; the message says what to change."""


def local_source_problem(source: str) -> str | None:
    """Why ``model.source`` cannot be a model when it is written as a local path (absolute, ``./``, ``../``, ``~``, or
    more than one ``/``: a hub id is ``owner/name``) or names something that exists: no such directory (naming the
    deepest folder that does exist), a file, or a directory without ``model_index.json``; None when it may be one
    (or is a hub id, left to the loader)."""
    import os
    from pathlib import Path

    text = str(source)
    path = Path(os.path.expanduser(text))
    looks_local = text.startswith(("/", "./", "../", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text
    if not looks_local and not os.path.lexists(path):
        return None
    fix = ("give the model's local diffusers directory (the folder holding model_index.json), or a hub id such as "
           "black-forest-labs/FLUX.1-dev")
    if not path.exists():
        parent = next((p for p in path.absolute().parents if p.is_dir()), None)
        where = f" ({parent} exists, {path.absolute().relative_to(parent).parts[0]!r} in it does not)" if parent else ""
        return f"model.source={text}: no such directory{where}; {fix}"
    if not path.is_dir():
        return f"model.source={text}: a file, not a model directory; {fix}"
    if not (path / "model_index.json").is_file():
        return f"model.source={text}: no model_index.json in this directory, so it is no diffusers model; {fix}"
    return None


def hub_message(e: BaseException) -> str:
    """The message of a loading error from diffusers or huggingface_hub, in one line: its pointer to "the stacktrace
    above" (which shardgen does not print) replaced by the cause it chained, if any."""
    text = " ".join(str(e).split())
    for pointer in ("Please check out the root cause in the stacktrace above.", "Check the parameter.",
                    "Please check the parameter."):
        text = text.replace(pointer, "").strip()
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text += f" (cause: {type(cause).__name__}: {' '.join(str(cause).split())[:300]})"
    return text.rstrip(".")
