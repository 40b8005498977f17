"""Settings every test process shares.

Ray's memory monitor kills ClientApp actors when the node's memory, as Ray counts it, passes
95 % (``RAY_memory_usage_threshold``). Under cgroup v1 Ray counts the active page cache as
used (rss + cache - inactive_file), and CI builds the compose test's Docker images beside the
suite: a CI run on 3b39922 saw the golden `default` scenario's status queries answered by
errors and its rows change from round 1, and holding 20 GB of this 24 GB machine while that
scenario runs reproduces it (``OutOfMemoryError`` from Ray in every status answer, the run
stopped by ``run.max-empty-rounds``). The tests pin rows, not Ray's memory policy: its
killer is off in every Ray cluster they start (they inherit this environment); the kernel's
OOM killer still guards real exhaustion. A user's run keeps Ray's default
(docs/tutorials/first-simulation.md says what it looks like and how to move it).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
