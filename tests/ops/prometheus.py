"""Debian's `prometheus` on a free loopback port, scraping one target every second, with our rules."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.fixtures import peers
from tools.ports import free_port


class PrometheusServer:
    def __init__(self, directory: Path, target: str, rule_files: list[Path], job: str = "ttg") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.target = target
        self.proc: subprocess.Popen[bytes] | None = None
        rules = "\n".join(f"  - {p}" for p in rule_files)
        (self.dir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
            f"rule_files:\n{rules}\n"
            f"scrape_configs:\n  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        prometheus = peers.tool("prometheus")
        log = (self.dir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                if r.status == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus not ready in {timeout_s} s: {self.log_tail()}")

    def query_url(self, expr: str) -> str:
        return self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})

    def query(self, expr: str) -> dict[str, Any]:
        """Synchronous (for use outside an event loop that serves the scraped target)."""
        with urllib.request.urlopen(self.query_url(expr), timeout=10) as r:
            result: dict[str, Any] = json.loads(r.read())
            return result

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "prometheus.log").read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None
