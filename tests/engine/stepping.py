"""Steps driven as the engine loop drives them: paused between each two layers."""

from __future__ import annotations

from collections.abc import Callable

from kvgate.engine.llm_engine import EngineStep, LLMEngine
from kvgate.engine.outputs import RequestOutput


def paused_step(
    engine: LLMEngine, at_pause: Callable[[EngineStep], None] | None = None
) -> list[RequestOutput]:
    """One step, advanced layer by layer (``EngineLoop._step``); ``at_pause`` runs at each
    pause between two layers, where it may add requests and call ``engine.step_urgent``."""
    step = engine.begin_step(pause=True)
    while step.advance():
        if at_pause is not None:
            at_pause(step)
    return engine.end_step(step)
