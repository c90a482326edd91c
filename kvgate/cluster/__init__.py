"""kvgate past one process: engine replicas on Ray Serve behind an OpenAI-compatible ingress
that routes by prefix-cache affinity (``serve run kvgate.cluster:app``, or ``kvgate serve
--replicas N``). Ray is imported only by what runs on it."""

from kvgate.cluster.app import app

__all__ = ["app"]
