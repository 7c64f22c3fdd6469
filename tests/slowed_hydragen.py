"""``python tests/slowed_hydragen.py SECONDS <hydragen arguments>``: the hydragen command with an injected
slow stage, a pause of SECONDS before every engine step.

Tests of a server process use it to keep requests in flight for as long as they need: a request of N
tokens takes at least N x SECONDS, however fast the machine is.
"""

import sys
import time

from hydragen.cli import main
from hydragen.engine.engine import Engine

delay = float(sys.argv[1])
real_step = Engine.step


def slowed_step(self):
    time.sleep(delay)
    return real_step(self)


Engine.step = slowed_step
sys.exit(main(sys.argv[2:]))
