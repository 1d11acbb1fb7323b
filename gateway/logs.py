"""The gateway's log lines: one line per record, UTC times (every process of the gateway logs alike)."""

from __future__ import annotations

import logging
import sys
import time

LOG_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s"
LOG_DATEFMT = "%Y-%m-%dT%H:%M:%S"


class OneLineFormatter(logging.Formatter):
    """`time level logger: message`, one line per record (a traceback is folded onto it with ' | ');
    times in UTC (the trailing Z), so logs of hosts in different zones line up."""

    def converter(self, secs: float | None) -> time.struct_time:
        return time.gmtime(secs)

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "").replace("\n", " | ")


def configure_logging(level: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(LOG_FORMAT, LOG_DATEFMT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
