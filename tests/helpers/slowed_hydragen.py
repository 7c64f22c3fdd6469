"""``python tests/helpers/slowed_hydragen.py SECONDS <hydragen arguments>``: the hydragen command with an
injected slow stage, a pause of SECONDS before every engine step.

Tests of a server process use it to keep requests in flight for as long as they need: a request of N
tokens takes at least N x SECONDS, however fast the machine is.

With ``HYDRAGEN_TEST_STALLS=DIR`` in its environment, a test can also hold or fault one process of several
(the replicas of a data-parallel front) by its pid, before any of its steps:

* while ``DIR/<pid>.stall`` exists the step waits (stuck for exactly as long as the test keeps the file);
* while ``DIR/<pid>.hold`` exists the step does nothing: the engine thread keeps taking requests, which
  wait (``hydragen_requests_waiting`` counts them), and the first step after the file is gone schedules
  them together, so a test that needs requests in one step sends them, sees them all waiting, then lets go;
* while ``DIR/<pid>.fail`` exists the step raises (an engine failure no request explains).

(Not ``HYDRAGEN_TEST_FAULTS``: that one is ``tests/helpers/tp_faults.py``'s, JSON faults a server may run
under too.)
"""

import os
import sys
import time

from hydragen.cli import main
from hydragen.engine.engine import EngineCore
from hydragen.engine.stats import EngineSnapshot

delay = float(sys.argv[1])
real_step = EngineCore.step
stalls = os.environ.get("HYDRAGEN_TEST_STALLS")


def slowed_step(self):
    time.sleep(delay)
    if stalls:
        mine = os.path.join(stalls, str(os.getpid()))
        while os.path.exists(mine + ".stall"):
            time.sleep(0.01)
        if os.path.exists(mine + ".hold"):
            time.sleep(0.01)  # no busy loop when SECONDS is 0
            self.snapshot = EngineSnapshot.of(self)  # the requests taken meanwhile, waiting
            return []
        if os.path.exists(mine + ".fail"):
            raise RuntimeError("injected engine failure")
    return real_step(self)


EngineCore.step = slowed_step
sys.exit(main(sys.argv[2:]))
