"""A real Prometheus server (Debian's package) for tests, plus promtool helpers.

Runs ``/usr/bin/prometheus`` on 127.0.0.1 with an ephemeral port and a
temporary storage dir under /dev/shm; ``close()`` stops it by PID
(terminate, then kill) and removes the directory.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from daemon_proc import Started, free_port

PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")
MISSING = (f"{PROMETHEUS} / {PROMTOOL} not installed (apt-get install prometheus; .ci/run does)"
           if not (PROMETHEUS.exists() and PROMTOOL.exists()) else "")


def promtool(*args: str, stdin: str | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([str(PROMTOOL), *args], input=stdin, capture_output=True, text=True, timeout=timeout)


class PrometheusProc(Started):
    """``with PrometheusProc(["127.0.0.1:9464"]) as prom: prom.query("up")``."""

    def __init__(self, targets: list[str], scrape_interval: str = "1s", rule_files: tuple[Path, ...] = ()):
        self.root = Path(tempfile.mkdtemp(prefix="ingestd-prom-", dir="/dev/shm"))
        self.config_path = self.root / "prometheus.yml"
        # JSON is YAML: no YAML library needed.
        self.config_path.write_text(json.dumps({
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": "ingestd", "static_configs": [{"targets": targets}]}],
            "rule_files": [str(path) for path in rule_files],
        }, indent=2))
        self.log_path = self.root / "prometheus.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "PrometheusProc":
        for _ in range(3):  # the free port may be taken between probing and binding: retry
            self.port = free_port()
            self._log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={self.config_path}", f"--storage.tsdb.path={self.root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=self._log, stderr=subprocess.STDOUT, cwd=self.root)
            if self._wait_ready(timeout):
                return self
            self._stop_proc()
        raise RuntimeError(f"prometheus did not become ready; log:\n{self.log()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=5.0) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:  # 400/422 carry the error in a JSON body
            body = json.load(exc)
        if body.get("status") != "success":
            raise ValueError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query; the result vector (or [] for an empty one)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def targets_up(self) -> bool:
        return any(t["health"] == "up" for t in self.api("targets")["activeTargets"])

    def _stop_proc(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def close(self) -> None:
        self._stop_proc()
        shutil.rmtree(self.root, ignore_errors=True)
