"""A dead pipeline stage under `python -m luceio.serve --devices cpu,cpu`: the next request gets
503 with the stage's exit code, and the process exits 1 with the reason (for its supervisor to
restart it) instead of hanging or answering from stage 0 alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil

from conftest import wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Serving:
    """A server subprocess; its stderr is read on a thread (so its logging never blocks)."""

    def __init__(self, *argv: str):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("LUCEIO_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "luceio.serve", "--port", "0", *argv],
                                     cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr),
                                       daemon=True)
        self.reader.start()

    def port(self) -> int:
        wait_for(lambda: any("Application startup complete" in s for s in self.lines)
                 or self.proc.poll() is not None, 120, "the server to start")
        assert self.proc.poll() is None, self.stderr()
        bound = next(s for s in self.lines if "; loading the model" in s)
        return int(bound.split("bound ")[1].split(";")[0].rsplit(":", 1)[1])

    def stage_pids(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.proc.pid).children()
                if "spawn_main" in " ".join(c.cmdline())]

    def stderr(self) -> str:
        self.reader.join(10)
        return "".join(self.lines)


def test_a_dead_stage_answers_503_and_exits_non_zero(tiny_llama):
    server = _Serving("--model", tiny_llama, "--devices", "cpu,cpu", "--dtype", "float32",
                      "--num-kv-blocks", "64", "--cpu-threads", "1")
    try:
        port = server.port()
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            ok = http.post("/v1/completions", json=body)
            assert ok.status_code == 200, ok.text
            [worker] = server.stage_pids()
            os.kill(worker, signal.SIGKILL)
            start = time.monotonic()
            r = http.post("/v1/completions", json=body)
            assert time.monotonic() - start < 10
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_dead"
        assert "stage 1" in err["message"] and "exited with code -9" in err["message"], err
        assert server.proc.wait(10) == 1
        last = server.stderr().splitlines()[-1]
        assert last.startswith("luceio: error: the engine died: pipeline stage failed: stage 1"), \
            server.stderr()
        assert time.monotonic() - start < 10
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)
