"""Starting a server from settings: :mod:`.settings` turns ``kvgate serve``'s arguments (and
its config file) into a ``Launch``; :mod:`.server` builds and runs the server of one. Used by
the CLI, the Ray replicas and the tests alike; nothing here imports the CLI."""

from kvgate.launch.settings import Launch, ModelToServe, parse_serve, serve_settings

__all__ = ["Launch", "ModelToServe", "parse_serve", "serve_settings"]
