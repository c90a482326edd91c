"""The server fixtures, for checking the monitoring assets against a live /metrics."""

from tests.server.conftest import api_keys_file, live_server

__all__ = ["api_keys_file", "live_server"]
