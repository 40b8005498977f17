"""EdgeFleet's algorithms as plain NumPy functions and classes, with no Flower import.

:mod:`~edgefleet.algorithms.saga` (SAGA server memory and its update, EH-FedSAG),
:mod:`~edgefleet.algorithms.selection` (energy-aware, age-based selection),
:mod:`~edgefleet.algorithms.warmstart` (warm-start weights and the session store),
:mod:`~edgefleet.algorithms.stopping` (the stopping rules' counters),
:mod:`~edgefleet.algorithms.tracker` (the session tracker). The Flower strategies in
:mod:`edgefleet.strategies` are the glue around them; these can be tested by hand and reused
outside Flower (``tests/test_algorithms_pure.py`` checks that none imports ``flwr``).
"""
