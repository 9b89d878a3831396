import torch

from bench_fixtures import fake_server, fake_server_session, flashlane_server, is_fake, server_url  # noqa: F401

# One intra-op thread in the test process: the tiny test models are dispatch-bound, and with
# server/engine threads alive in the same process a 2-thread OpenMP pool spends its time waiting
# (measured: one engine test went from 5 s alone to 480 s inside the full suite).
torch.set_num_threads(1)
