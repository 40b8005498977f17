"""Test hook (tests/test_loaded_start.py): Ray actors whose ClientApp takes long to start.

On ``PYTHONPATH``, which a run passes on to its Ray workers: when ``EDGEFLEET_TEST_ACTOR_DELAY_S``
is set, a Ray worker that imports EdgeFleet's ClientApp module sleeps that long first, as an
actor on a loaded machine takes long to import torch and load its data. Other processes (the
Simulation Engine's driver loads the same module) are not delayed.
"""

import os

if os.environ.get("EDGEFLEET_TEST_ACTOR_DELAY_S"):
    import importlib.abc
    import sys
    import time

    _DELAY = float(os.environ["EDGEFLEET_TEST_ACTOR_DELAY_S"])

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "edgefleet.client.app" or "default_worker" not in " ".join(sys.argv[:1]):
                return None
            time.sleep(_DELAY)
            return None  # the normal finders load the module

    sys.meta_path.insert(0, _Finder())
