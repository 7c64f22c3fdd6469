import sys

from hydragen.cli import main

sys.exit(main())
