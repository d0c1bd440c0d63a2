"""The records of a training call: the loss of the steps since the last record, kept on the
device so that no step waits for it; the throughput; and each record, written to the run's
metrics log (:class:`adaspan.run.metrics.MetricsLog`) and formatted for the log line."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..model.analysis import span_summary
from ..run.metrics import MetricsLog


@dataclass
class LossWindow:
    """The steps since the last record: their summed and largest loss, on the device (read
    at records only), and their wall time."""

    nll: Tensor | None = None
    worst: Tensor | None = None
    steps: int = 0
    start: float = field(default_factory=time.monotonic)

    def add(self, nll: Tensor) -> None:
        self.nll = nll if self.nll is None else self.nll + nll
        self.worst = nll if self.worst is None else torch.maximum(self.worst, nll)
        self.steps += 1

    def read(self) -> tuple[float, float]:
        """The mean and the largest loss of the steps (nats), read from the device."""
        total, worst = torch.stack([self.nll, self.worst]).tolist()
        return total / self.steps, worst


class Recorder:
    """Records of a call that trains ``steps`` steps of ``chars_per_step`` tokens (each a
    ``unit``: a byte, a word, ...), written to ``metrics`` (None: this process writes none,
    e.g. a rank other than 0). The key ``chars_per_s`` counts tokens whatever they are."""

    def __init__(self, metrics: MetricsLog | None, chars_per_step: int, steps: int,
                 unit: str = "char") -> None:
        self.metrics, self.chars_per_step, self.steps = metrics, chars_per_step, steps
        self.unit = "char" if unit == "character" else unit
        self.window = LossWindow()
        self.trained = (0, 0.0)  # steps and seconds of training of this call, at the last record
        self.last: dict = {"train_bpc": None, "valid_bpc": None, "lr": None}

    def add(self, nll: Tensor, lr: float) -> None:
        """A step done at learning rate ``lr`` with mean loss ``nll`` (on the device)."""
        self.window.add(nll)
        self.last["lr"] = lr

    def pause(self, seconds: float) -> None:
        """``seconds`` spent on something other than training (saving) since the window
        began."""
        self.window.start += seconds

    def record(self, step: int, train_bpc: float, valid_bpc: float | None,
               spans: list[list[float]], **more: object) -> dict:
        """The record of ``step`` (the ``spans`` of every head per layer; ``more`` fields after
        the span fields), written to the metrics log; the window starts again."""
        seconds = time.monotonic() - self.window.start
        steps = self.window.steps
        self.trained = (self.trained[0] + steps, self.trained[1] + seconds)
        summary = span_summary(spans)
        record = {"step": step, "train_bpc": train_bpc, "valid_bpc": valid_bpc,
                  "lr": self.last["lr"], "chars_per_s": steps * self.chars_per_step / seconds,
                  "avg_span": summary["avg_span"], "max_span": summary["max_span"],
                  "layer_avg_span": summary["layer_avg"],
                  "layer_max_span": [max(layer) for layer in spans],
                  "head_spans": [[round(s, 1) for s in layer] for layer in spans], **more}
        if self.metrics is not None:
            self.metrics.write(record)
        self.last.update({k: v for k, v in record.items() if v is not None})
        self.window = LossWindow()
        return record

    def summary(self, step: int, spans: list[list[float]], stopped: str,
                **more: object) -> dict:
        """What a training call returns: its last ``step``, last bpc, characters per second
        over its records, the ``spans`` (average, longest, all), why it ``stopped``, then
        ``more``."""
        summary = span_summary(spans)
        steps, seconds = self.trained
        return {"steps": step, "train_bpc": self.last["train_bpc"],
                "valid_bpc": self.last["valid_bpc"],
                "chars_per_s": steps * self.chars_per_step / seconds if seconds else None,
                "avg_span": summary["avg_span"], "max_span": summary["max_span"], "spans": spans,
                "stopped": stopped, **more}

    @staticmethod
    def summary_line(summary: dict) -> str:
        """The last line of a training call's log."""
        return (f"{summary['stopped']} at step {summary['steps']:,}: train bpc "
                f"{bpc(summary['train_bpc'])}, valid bpc {bpc(summary['valid_bpc'])}, span avg "
                f"{summary['avg_span']:.0f} max {summary['max_span']:.0f}")

    def line(self, record: dict) -> str:
        """``record`` as one line of the training log."""
        return (f"step {record['step']}/{self.steps} | train bpc {bpc(record['train_bpc'])} | "
                f"valid bpc {bpc(record['valid_bpc'])} | lr {record['lr']:.3g} | "
                f"{record['chars_per_s'] or 0:,.0f} {self.unit}s/s | "
                f"span avg {record['avg_span']:.0f} max {record['max_span']:.0f}")

    @staticmethod
    def postfix(record: dict) -> dict[str, str]:
        """``record``'s figures beside the progress bar."""
        return {"bpc": f"{record['train_bpc']:.3f}", "chars/s": f"{record['chars_per_s']:,.0f}",
                "span avg/max": f"{record['avg_span']:.0f}/{record['max_span']:.0f}",
                "lr": f"{record['lr']:.2e}"}

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def bpc(value: float | None) -> str:
    """A bpc for the log: 4 decimals, or ``-`` where there is none."""
    return "-" if value is None else f"{value:.4f}"
