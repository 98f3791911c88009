"""Asynchronous snapshot export: the trainer blocks only for the copy off its device (:class:`AsyncExporter`).

Limits: tensors must be gathered (no DTensor); the staging root must exist or be creatable. See docs/PROTOCOL.md §4.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpteval.coord.snapshots.gc import has_room
from ckpteval.coord.snapshots.snapshot import CANARY, publish_snapshot
from ckpteval.jobs.trainer.export.adapter import adapter_state, is_peft_model
from ckpteval.jobs.trainer.export.hf_files import snapshot_host_copy, write_adapter_files, write_hf_files
from ckpteval.jobs.trainer.export.safetensors_io import write_chunks

RoomCheck = Callable[[Path, int], bool]


@dataclass(frozen=True)
class ExportOutcome:
    step: int
    ok: bool
    path: Path | None
    blocked_s: float
    total_s: float
    error: str = ""


def state_dict_bytes(model_or_state_dict: torch.nn.Module | Mapping[str, Any]) -> int:
    """Bytes of the distinct tensors of a model/state dict (tied weights counted once)."""
    source = (
        model_or_state_dict.state_dict()
        if isinstance(model_or_state_dict, torch.nn.Module)
        else model_or_state_dict
    )
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for tensor in source.values():
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            continue
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
        )
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


class AsyncExporter:
    """Exports snapshots into ``staging_root`` with at most one export in flight."""

    def __init__(
        self,
        staging_root: Path,
        base_model_dir: Path | None,
        *,
        room_check: RoomCheck = has_room,
        max_shard_bytes: int = 2 * 1024**3,
        producer: dict[str, Any] | None = None,
        run: str | None = None,
    ) -> None:
        self.run = run  # the run key stamped into every marker (ckpteval.coord.run.identity)
        self.staging_root = Path(staging_root)
        self.staging_root.mkdir(parents=True, exist_ok=True)
        self.base_model_dir = None if base_model_dir is None else Path(base_model_dir)
        self.room_check = room_check
        self.max_shard_bytes = max_shard_bytes
        self.producer = producer
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._done: list[ExportOutcome] = []
        self._bug: BaseException | None = None

    # -- trainer side -------------------------------------------------------------------------------
    def submit(
        self, step: int, model: torch.nn.Module | Mapping[str, Any], config: Any = None, canary: bytes | None = None
    ) -> None:
        """Start exporting ``step``; returns after the host copy. The outcome comes from :meth:`poll`.

        ``canary``: the bytes of the snapshot's :data:`ckpteval.coord.snapshots.snapshot.CANARY` (:mod:`ckpteval.jobs.eval.proof.canary`),
        written with the weights and listed in the marker."""
        t0 = time.perf_counter()
        self._join()
        adapter_config: dict[str, Any] | None = None
        if is_peft_model(model):  # a LoRA run: export the adapter only, never the (fixed) base
            try:
                model, adapter_config = adapter_state(model)
            except ValueError as e:
                elapsed = time.perf_counter() - t0
                self._finish(ExportOutcome(step, False, None, elapsed, elapsed, f"adapter export: {e}"))
                return
        nbytes = state_dict_bytes(model)
        if not self.room_check(self.staging_root, nbytes):
            self._finish(
                ExportOutcome(
                    step,
                    False,
                    None,
                    time.perf_counter() - t0,
                    time.perf_counter() - t0,
                    f"no room on {self.staging_root} for {nbytes} bytes (+ safety margin)",
                )
            )
            return
        if adapter_config is not None:
            config = adapter_config
        elif config is None and isinstance(model, torch.nn.Module):
            config = getattr(model, "config", None)
        try:
            host = snapshot_host_copy(model)
        except (ValueError, RuntimeError) as e:
            elapsed = time.perf_counter() - t0
            self._finish(ExportOutcome(step, False, None, elapsed, elapsed, f"host copy failed: {e}"))
            return
        blocked = time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._write,
            args=(step, host, config, t0, blocked, adapter_config is not None, canary),
            name=f"export-{step}",
            daemon=True,
        )
        self._thread.start()

    def poll(self) -> list[ExportOutcome]:
        """Outcomes finished since the last poll (never blocks)."""
        with self._lock:
            if self._bug is not None:
                bug, self._bug = self._bug, None
                raise RuntimeError("export thread crashed") from bug
            done, self._done = self._done, []
        return done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the export in flight (if any); True if none is left running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _finish(self, outcome: ExportOutcome) -> None:
        with self._lock:
            self._done.append(outcome)

    # -- background thread --------------------------------------------------------------------------
    def _write(
        self, step: int, host: dict[str, torch.Tensor], config: Any, t0: float, blocked: float, adapter: bool,
        canary: bytes | None,
    ) -> None:
        def write_files(tmp: Path) -> dict[str, dict[str, Any]]:
            if adapter:
                records = write_adapter_files(tmp, host, config)
            else:
                records = write_hf_files(
                    tmp, host, self.base_model_dir, config=config, max_shard_bytes=self.max_shard_bytes
                )
            if canary is not None:
                records[CANARY] = write_chunks(tmp / CANARY, [canary], zlib.crc32, fsync=False)
            return records

        try:
            path = publish_snapshot(self.staging_root, step, write_files, producer=self.producer, run=self.run)
            outcome = ExportOutcome(step, True, path, blocked, time.perf_counter() - t0)
        except (OSError, ValueError, RuntimeError) as e:
            outcome = ExportOutcome(
                step, False, None, blocked, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
            )
        except BaseException as e:  # a bug: surface it in the training thread
            with self._lock:
                self._bug = e
            return
        finally:
            host.clear()  # release the host copy before the next export may start
        self._finish(outcome)
