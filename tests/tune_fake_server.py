"""The bench's fake OpenAI-compatible server as a process, for tune tests: it accepts knob flags
and can be told to die mid-run. `--die-after-requests N` SIGKILLs itself once N completion
requests arrived (what an OOM kill looks like from outside); an unknown flag makes it exit 2
before it is healthy (argparse), like a server refusing a bad option."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from bench_fake_server import FakeConfig, FakeServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--token-delay", type=float, default=0.001)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--die-after-requests", type=int, default=None)
    a = p.parse_args()
    srv = FakeServer(FakeConfig(model=a.model, token_delay_s=a.token_delay, max_running=a.max_running), port=a.port)
    signal.signal(signal.SIGTERM, lambda *_: setattr(srv.server, "should_exit", True))
    if a.die_after_requests:
        def watch():
            while srv.state.count < a.die_after_requests:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watch, daemon=True).start()
    srv.server.run()


if __name__ == "__main__":
    main()
