"""Adapter names → versioned internal adapters, re-pointed atomically and freed when no request uses them.

Both engines keep weights under an internal name per version (`policy@42`); the public name is a pointer.
A request `acquire`s the slot the name points to when it starts and `release`s it when done, so a swap never
changes the weights under a running request, and the old weights are deleted by whoever drops the last reference.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from metaclaw.runfiles.layout import adapter_version
from metaclaw.serving.engines.base import AdapterError, UnknownAdapterError
from metaclaw.wire import ADAPTER_CONFIG, ADAPTER_WEIGHTS

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def check_adapter_files(path: str | Path) -> Path:
    """The adapter directory, once it holds a config and safetensors weights; engines refuse anything else
    (vLLM would fall back to a pickled `adapter_model.bin`)."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"adapter path {str(directory)!r} is not a directory")
    if not (directory / ADAPTER_CONFIG).is_file():
        raise AdapterError(f"{ADAPTER_CONFIG} is missing in {str(directory)!r}")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{ADAPTER_WEIGHTS} is missing in {str(directory)!r} (only safetensors adapters load)")
    return directory


def check_adapter_name(name: object) -> str:
    """Adapter names are short printable identifiers (they travel in the OpenAI `model` field)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"lora_name must match {_NAME.pattern}, got {name!r}")
    return name


@dataclass
class LoadedAdapter:
    """One loaded version of a named adapter."""

    name: str
    internal: str
    version: int
    path: str
    refs: int = 0
    retired: bool = False


class AdapterRegistry:
    """Thread-safe name → slot mapping with reference counts (no model access: engines free the weights)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[str, LoadedAdapter] = {}
        self._versions: dict[str, int] = {}  # last version per name, kept after unload so versions only grow

    def next_version(self, name: str, path: str | Path, version: int | None = None) -> int:
        """`version` (the request's), else the version the adapter folder records (`metaclaw.runfiles.layout`),
        when it is newer; else the previous version + 1 (versions only grow)."""
        with self._lock:
            previous = self._versions.get(name, 0)
        if version is None:
            version = adapter_version(path)
        return version if version is not None and version > previous else previous + 1

    def publish(self, slot: LoadedAdapter) -> LoadedAdapter | None:
        """Point `slot.name` at `slot`; returns the replaced slot if nothing uses it any more (free it now)."""
        with self._lock:
            old = self._slots.get(slot.name)
            self._slots[slot.name] = slot
            self._versions[slot.name] = max(slot.version, self._versions.get(slot.name, 0))
            return self._retire(old)

    def remove(self, name: str) -> LoadedAdapter | None:
        """Drop `name`; returns its slot if it can be freed now (else the last request frees it)."""
        with self._lock:
            if name not in self._slots:
                raise UnknownAdapterError(name)
            return self._retire(self._slots.pop(name))

    def acquire(self, name: str) -> LoadedAdapter:
        """The slot `name` points to now, pinned until `release`."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is None:
                raise UnknownAdapterError(name)
            slot.refs += 1
            return slot

    def release(self, slot: LoadedAdapter) -> LoadedAdapter | None:
        """Unpin; returns the slot when it was retired and this was the last user (free it now)."""
        with self._lock:
            slot.refs -= 1
            return slot if slot.retired and slot.refs == 0 else None

    def current(self, name: str) -> LoadedAdapter:
        with self._lock:
            slot = self._slots.get(name)
        if slot is None:
            raise UnknownAdapterError(name)
        return slot

    def versions(self) -> dict[str, int]:
        with self._lock:
            return {name: slot.version for name, slot in self._slots.items()}

    @staticmethod
    def _retire(old: LoadedAdapter | None) -> LoadedAdapter | None:
        if old is None:
            return None
        old.retired = True
        return old if old.refs == 0 else None


class ServedAdapters:
    """What every engine does alike with its named adapters; engines set `model_name` and `_registry` and
    define `_free(slot)`, which releases one version's weights."""

    model_name: str
    _registry: AdapterRegistry
    _free: Callable[[LoadedAdapter], None]

    def adapters(self) -> dict[str, int]:
        return self._registry.versions()

    def adapter_version(self, name: str | None) -> int | None:
        return None if self._is_base(name) else self._registry.current(name).version

    @contextmanager
    def _pinned_slot(self, adapter: str | None) -> Iterator[LoadedAdapter | None]:
        """Resolve `adapter` to the version it points to now and keep that version alive until the block ends."""
        if adapter is None or self._is_base(adapter):
            yield None
            return
        slot = self._registry.acquire(adapter)
        try:
            yield slot
        finally:
            if self._registry.release(slot) is not None:
                self._free(slot)

    def _is_base(self, adapter: str | None) -> bool:
        return adapter is None or adapter == self.model_name

    def _check_new_name(self, name: str) -> None:
        check_adapter_name(name)
        if name == self.model_name:
            raise ValueError(f"lora_name {name!r} is the base model's name")

    def unload_adapter(self, name: str) -> None:
        slot = self._registry.remove(name)
        if slot is not None:
            self._free(slot)
        log.info("Unloaded adapter %s", name)

    def _publish(self, name: str, internal: str, version: int, path: str, started: float) -> int:
        """Re-point `name` at the loaded `internal` weights; the old version is freed once no request uses it."""
        old = self._registry.publish(LoadedAdapter(name=name, internal=internal, version=version, path=str(path)))
        if old is not None:
            self._free(old)
        log.info("Loaded adapter %s v%d from %s in %.0f ms", name, version, path, 1e3 * (time.perf_counter() - started))
        return version

    def prompt_logprobs(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        adapter: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[float]:
        """`[len(target_ids)]` teacher logprobs: `score_tokens` without the ranks."""
        return [s.logprob for s in self.score_tokens(prompt_ids, target_ids, adapter, temperature, top_p, top_k)]
