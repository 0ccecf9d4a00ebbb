"""Serving: the daemon, its gRPC servicer and OpenAI-compatible HTTP front,
the admission both share, start-up checks, reflection, systemd notification,
metrics and logging. Front ends talk to `AsyncEngine` only."""
