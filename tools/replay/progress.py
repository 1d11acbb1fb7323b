"""Live progress of a run in the terminal (rich)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.live import Live
from rich.table import Table


@dataclass(frozen=True, slots=True)
class Snapshot:
    elapsed_s: float
    active: int
    started: int
    total: int | None
    completed: int
    rejected: int
    failed: int
    pps: float
    partials: int
    finals: int
    setup_p50_ms: float | None


COLUMNS = (
    "elapsed",
    "active",
    "started",
    "done",
    "rejected",
    "failed",
    "RTP pps",
    "partials",
    "finals",
    "setup p50",
)


class LiveView:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._live = Live(console=self.console, refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.__exit__(None, None, None)

    def update(self, s: Snapshot) -> None:
        table = Table(title="ttg replay", title_justify="left", show_header=True, header_style="bold")
        for col in COLUMNS:
            table.add_column(col, justify="right")
        total = "" if s.total is None else f"/{s.total}"
        table.add_row(
            f"{s.elapsed_s:.0f} s",
            str(s.active),
            f"{s.started}{total}",
            str(s.completed),
            str(s.rejected),
            str(s.failed),
            f"{s.pps:.0f}",
            str(s.partials),
            str(s.finals),
            "–" if s.setup_p50_ms is None else f"{s.setup_p50_ms:.1f} ms",
        )
        self._live.update(table)
