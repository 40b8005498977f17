"""A live dashboard and Prometheus metrics for a run folder (``edgefleet dashboard RUN_DIR``).

:mod:`edgefleet.dashboard.app` serves the page and its JSON, event and ``/metrics``
endpoints, reading ``fleet.json`` and ``metrics.jsonl`` (:mod:`edgefleet.dashboard.data`) on
every request; :mod:`edgefleet.dashboard.metrics` turns them into Prometheus' format. The
chart library (uPlot, MIT licence) is vendored under ``static/vendor``: the page needs no
network beyond the dashboard itself.
"""
