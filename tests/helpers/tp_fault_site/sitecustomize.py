"""Installs the faults of ``HYDRAGEN_TEST_FAULTS`` in every Python process started with this folder on
PYTHONPATH (tests/helpers/tp_faults.py); inert without that variable."""

import os
import sys

if os.environ.get("HYDRAGEN_TEST_FAULTS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tp_faults

    tp_faults.install_from_environment()
