"""Shard containers: the file format a shard's samples are written into (``shard_container``; tar by default).

A container is one single-file, append-only format with three parts, registered once by name
(``register_container``); the name is also the shard files' extension (``000042.tar``):

- ``writer(path, prefix_of=, prefix_bytes=, prefix_sha256=)``: a partial file under construction, which
  appends ``(member name, bytes)`` lists, reports its durable byte length at ``sync()`` (a checkpoint offset) and
  the sha256 of the bytes written so far, and closes the container at ``finish()``. Resuming copies a verified
  prefix of an earlier partial, so the file cut at any checkpointed offset must be a valid prefix of the format
  (``PartialTar`` is the model).
- ``scan(path, keys, limit=)``: the whole samples a (partial or committed) file holds, in the order ``keys``
  gives them, where the last whole sample ends and whether the container is closed (a ``ShardScan``).
- ``read_members(path or file object)``: key -> {extension: bytes} of a committed file.

Everything else (checkpoints, the shard index, commit by rename, uploads, the tools) works on these three, so a
new container is one module that registers itself. The run records its container in plan/plan.json; a launch
asking for another is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Protocol

from shardgen.dataio.shards.tarshard import PartialTar, ShardScan, read_tar_members, scan_tar
from shardgen.errors import UserError

DEFAULT = "tar"


class ContainerError(UserError, ValueError):
    """An unknown ``shard_container``; the message lists the known ones."""


class PartialShard(Protocol):
    """A shard file under construction (``PartialTar`` is the tar one)."""

    path: Path
    bytes: int

    @property
    def sha256(self) -> str: ...

    def append(self, members: list[tuple[str, bytes]]) -> None: ...

    def sync(self) -> int: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...

    def discard(self) -> None: ...


@dataclass(frozen=True)
class ShardContainer:
    """One container format: its name (the shard files' extension) and its writer, scanner and reader."""

    name: str
    writer: Callable[..., PartialShard]
    scan: Callable[..., ShardScan]
    read_members: Callable[[str | Path | BinaryIO], dict[str, dict[str, bytes]]]

    @property
    def suffix(self) -> str:
        """``.name``: the shard files' extension."""
        return f".{self.name}"


_CONTAINERS: dict[str, ShardContainer] = {}


def register_container(container: ShardContainer) -> ShardContainer:
    """Make ``container`` available as ``shard_container=<its name>``."""
    if not container.name.isalnum():
        raise ValueError(f"a shard container's name is its file extension: letters and digits only, "
                         f"not {container.name!r}")
    _CONTAINERS[container.name] = container
    return container


def unregister_container(name: str) -> None:
    """Forget a registered container (tests)."""
    _CONTAINERS.pop(name, None)


def container_names() -> list[str]:
    """The registered containers' names."""
    return sorted(_CONTAINERS)


def get_container(name: str | None = None) -> ShardContainer:
    """The container registered as ``name`` (default: tar); ContainerError naming the known ones otherwise."""
    name = name or DEFAULT
    try:
        return _CONTAINERS[name]
    except KeyError:
        raise ContainerError(f"shard_container={name!r} is not a known shard container; use one of "
                             f"{sorted(_CONTAINERS)}") from None


TAR = register_container(ShardContainer(DEFAULT, writer=PartialTar, scan=scan_tar, read_members=read_tar_members))
"""webdataset's container (shardgen/dataio/shards/tarshard.py): the default ``shard_container``."""


def read_shard_members(path: str | Path | BinaryIO, container: str | None = None) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes} of one committed shard file (a path or a file object) in ``container`` (default
    tar); raises on an unreadable file."""
    return get_container(container).read_members(path)
