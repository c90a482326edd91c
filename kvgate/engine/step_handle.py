"""A step in flight, as a handle its owner advances: the runner never calls back into the
engine. Pure Python (no tensors): the fakes in the tests make them too.

The runner's ``start(out, pause=True)`` returns a ``RunnerStep`` whose forward is suspended
at each pause between two layers of the model. The engine loop advances it one pause at a
time, and between two advances it may take in new requests and run a whole other step (an
urgent prefill for other sequences) before resuming this one, which keeps its own
activations and block tables. Nothing of it is on the stack meanwhile: it is a generator.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Protocol

from kvgate.engine.messages import RunnerOutput, SchedulerOutput


class RunnerStep:
    """``advance`` runs the step up to its next pause; ``finish`` runs whatever is left and
    returns its tokens. An exception raised in the step propagates from the call that ran
    the part that raised it; the step is closed then (nothing half-run is left behind)."""

    def __init__(self, body: Generator[None, None, RunnerOutput]) -> None:
        self._body: Generator[None, None, RunnerOutput] | None = body
        self._output: RunnerOutput | None = None

    @classmethod
    def done(cls, output: RunnerOutput) -> RunnerStep:
        """A step with nothing left to run (an empty step, or one computed at once)."""
        step = cls.__new__(cls)
        step._body, step._output = None, output
        return step

    @property
    def is_done(self) -> bool:
        return self._body is None

    def advance(self) -> bool:
        """Run up to the next pause. True: paused, with more to run; False: done (nothing
        is left for ``finish`` but to return the output)."""
        body = self._body
        if body is None:
            return False
        try:
            next(body)
        except StopIteration as stop:
            self._output, self._body = stop.value, None
            return False
        except BaseException:
            self.close()
            raise
        return True

    def finish(self) -> RunnerOutput:
        """Run the rest of the step (without pausing) and return what it produced."""
        while self.advance():
            pass
        assert self._output is not None
        return self._output

    def close(self) -> None:
        """Abandon the step where it stands (after an error)."""
        body, self._body = self._body, None
        if body is not None:
            body.close()


class StepRunner(Protocol):
    """What the engine needs of a runner: a step started from a schedule."""

    def start(self, out: SchedulerOutput, pause: bool = False) -> RunnerStep:
        """Begin the step ``out``; with ``pause``, suspended between each two layers."""
        ...
