"""What runs on a Ray node for one engine rank: `EngineCoreActor`, and the model it needs there.

The actor gets its `EngineCoreProcArgs` (options, addresses, its CURVE keys) as constructor arguments,
through Ray, and runs the engine core in its main thread exactly as a child process does. Before it
builds the engine it makes sure the model is on its node: either the model path (the same on every
node) exists there, or the frontend shipped the files through Ray's object store (`ray_ship_model`),
and the actor writes them to a private temp folder that it removes when it ends. A model that is not
there fails the start with an error naming the node.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nanoserve.model_files import resolve_model_path

if TYPE_CHECKING:
    from nanoserve.core.engine_core_proc import EngineCoreProcArgs

MAX_SHIPPED_MODEL_BYTES = 2 * 1024**3
"""Beyond this a model is not sent through the object store (each node's store holds a copy while
the actors unpack it): put it at the same path on every node instead."""


@dataclass(frozen=True)
class ShippedModel:
    """A model's files as sent to the nodes: relative path -> bytes; `entry` is the path the engine
    loads, relative to where they are written ("" for an HF folder, the file's name for a GGUF)."""

    files: dict[str, bytes]
    entry: str

    @property
    def num_bytes(self) -> int:
        return sum(len(data) for data in self.files.values())


def pack_model(model: str | None) -> ShippedModel:
    """Read the model (a .gguf file or an HF folder, as the frontend resolves it) to ship it."""
    path = Path(resolve_model_path(model))
    if path.is_file():
        members, entry = [path], path.name
    else:
        members, entry = sorted(p for p in path.rglob("*") if p.is_file()), ""
    size = sum(p.stat().st_size for p in members)
    if size > MAX_SHIPPED_MODEL_BYTES:
        raise ValueError(
            f"ray_ship_model: the model at {str(path)!r} is {size / 1024**3:.1f} GiB, more than the "
            f"{MAX_SHIPPED_MODEL_BYTES / 1024**3:g} GiB sent through Ray's object store; put it at the same path "
            "on every node instead."
        )
    root = path.parent if path.is_file() else path
    return ShippedModel({str(p.relative_to(root)): p.read_bytes() for p in members}, entry)


def unpack_model(shipped: ShippedModel) -> tuple[str, str]:
    """Write the shipped files to a new temp folder; returns (folder, model path to load)."""
    folder = tempfile.mkdtemp(prefix="nanoserve-model-")
    for name, data in shipped.files.items():
        target = Path(folder, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return folder, os.path.join(folder, shipped.entry) if shipped.entry else folder


class EngineCoreActor:
    """One engine-core rank inside a Ray actor; `run` is its whole working life."""

    def __init__(self, args: EngineCoreProcArgs, model: ShippedModel | None = None) -> None:
        self.args = args
        self.model = model

    def where(self) -> tuple[int, str, str]:
        """(pid, node IP, node id)."""
        import ray

        return os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def run(self) -> int:
        """Serve until asked to stop (0) or a failure (1, after sending the death record to the frontend)."""
        from nanoserve.core.bootstrap import serve_engine_core, setup_logging

        setup_logging(self.args.engine_rank)
        folder = None
        try:
            if self.model is not None:
                folder, path = unpack_model(self.model)
                self.model = None  # the bytes are on disk now
            else:
                path = self.local_model_path()
            args = dataclasses.replace(self.args, options=dataclasses.replace(self.args.options, model=path))
            return serve_engine_core(args, (signal.SIGTERM,))
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def local_model_path(self) -> str:
        try:
            return resolve_model_path(self.args.options.model)
        except (FileNotFoundError, ValueError) as e:
            _, ip, node_id = self.where()
            raise type(e)(
                f"On Ray node {ip} (node id {node_id}): {e} Put the model at the same path on every node, or "
                "pass ray_ship_model=True (--ray-ship-model) to send it through Ray's object store."
            ) from None
