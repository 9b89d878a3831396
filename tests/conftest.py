import os
import signal
import tempfile

import torch

from bench_fixtures import fake_server, fake_server_session, flashlane_server, is_fake, server_url  # noqa: F401

# One intra-op thread in the test process: the tiny test models are dispatch-bound, and with
# server/engine threads alive in the same process a 2-thread OpenMP pool spends its time waiting
# (measured: one engine test went from 5 s alone to 480 s inside the full suite).
torch.set_num_threads(1)

# dtype="auto" times fp32 against bf16 on CPUs with native bf16; the tests compare against fp32
# references whatever CPU runs them (subprocess servers inherit this too).
os.environ.setdefault("FLASHLANE_AUTO_DTYPE", "float32")
# int8: one kernel at every row count, not this machine's timed choice (batched == alone holds)
os.environ.setdefault("FLASHLANE_INT8_KERNEL", "int8pack")

# bench / compare / tune runs register themselves in $FLASHLANE_HOME/results.db and keep tune
# studies there: tests write to a throwaway home, never the user's ~/.flashlane.
os.environ.setdefault("FLASHLANE_HOME", tempfile.mkdtemp(prefix="flashlane-test-home-"))

# A suite started in the background by a non-interactive shell (nohup, `cmd &`) has SIGINT
# ignored, and an ignored signal stays ignored across exec: the Ctrl-C tests' children would
# never see their SIGINT and run to the end (seen: both such tests failed in a nohup'd run).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
