"""One module per model family: what it declares (``model/family.py``), listed in ``model/registry.py``."""
