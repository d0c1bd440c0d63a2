"""Training metrics: one JSON record per line of a file (a run's ``metrics.jsonl``), written
and read back, and TensorBoard events if TensorBoard is installed. Where the files are is the
run directory's to say (:class:`adaspan.run.checkpoint.RunDir`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..data.files import atomic_write


class MetricsLog:
    """Metrics records appended to the file ``path`` and, with ``tensorboard_dir`` and if
    TensorBoard is installed, written there as events; a run resumed at ``start_step`` first
    drops the records logged after it."""

    def __init__(self, path: Path, start_step: int, tensorboard_dir: Path | None) -> None:
        self.path = path
        if start_step and self.path.exists():
            _drop_records_after(self.path, start_step)
        self.writer = (_summary_writer(tensorboard_dir, start_step)
                       if tensorboard_dir is not None else None)

    def write(self, record: dict) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in _scalars(record):
                self.writer.add_scalar(name, value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _scalars(record: dict) -> list[tuple[str, float]]:
    """The record's numbers as TensorBoard scalars: a list ``x`` becomes ``x/0``, ``x/1``...,
    a list of lists ``x/0/0``, ``x/0/1``... (words, such as the precision, are left out)."""
    scalars = []
    for name, value in record.items():
        if isinstance(value, list):
            for i, item in enumerate(value):
                scalars += _scalars({f"{name}/{i}": item})
        elif name != "step" and isinstance(value, int | float):
            scalars.append((name, value))
    return scalars


def read_metrics(path: str | Path) -> list[dict]:
    """The records of the file ``path`` (none if it does not exist; unparseable lines, such as
    one cut short by a crash, are skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _drop_records_after(path: Path, step: int) -> None:
    """Forget records logged after the checkpoint a run resumes from (they will be redone)."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by a crash
    atomic_write({path: lambda temp: temp.write_text("".join(kept))})


def _summary_writer(log_dir: Path, start_step: int):
    """A TensorBoard writer dropping events after ``start_step``, or None without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)
