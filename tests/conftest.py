from bench_fixtures import fake_server, fake_server_session, flashlane_server, is_fake, server_url  # noqa: F401
