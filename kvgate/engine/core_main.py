"""``python -m kvgate.engine.core_main``: the engine process (``core_proc.run_core``), its
arguments pickled on standard input. A module of its own, so that what the process pickles
names ``kvgate.engine.core_proc``'s classes, never ``__main__``'s."""

import pickle
import sys

from kvgate.engine.core_proc import run_core

if __name__ == "__main__":
    run_core(*pickle.load(sys.stdin.buffer))
