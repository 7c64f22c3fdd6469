"""``python tests/helpers/slowed_hydragen.py SECONDS <hydragen arguments>``: the hydragen command with an
injected slow stage, a pause of SECONDS before every engine step.

Tests of a server process use it to keep requests in flight for as long as they need: a request of N
tokens takes at least N x SECONDS, however fast the machine is.

With ``HYDRAGEN_TEST_FAULTS=DIR`` in its environment, a test can also fault one process of several (the
replicas of a data-parallel front) by its pid, before any of its steps: while ``DIR/<pid>.stall`` exists the
step waits (stuck for exactly as long as the test keeps the file), and while ``DIR/<pid>.fail`` exists the
step raises (an engine failure no request explains).
"""

import os
import sys
import time

from hydragen.cli import main
from hydragen.engine.engine import EngineCore

delay = float(sys.argv[1])
real_step = EngineCore.step
faults = os.environ.get("HYDRAGEN_TEST_FAULTS")


def slowed_step(self):
    time.sleep(delay)
    if faults:
        mine = os.path.join(faults, str(os.getpid()))
        while os.path.exists(mine + ".stall"):
            time.sleep(0.01)
        if os.path.exists(mine + ".fail"):
            raise RuntimeError("injected engine failure")
    return real_step(self)


EngineCore.step = slowed_step
sys.exit(main(sys.argv[2:]))
