"""One family for bad settings.

Every error that means "this setting (a run-config key, a constructor argument, a node's
config) is wrong" derives from :class:`SettingError`, so a caller catches them all with one
``except``, and each message names the setting, what was given and the valid choices. It is
a ``ValueError``: code that caught the old per-module classes as ``ValueError`` still does.
Errors about state (a corrupt checkpoint, a missing data set, a dead process) are not here.
"""

from __future__ import annotations


class SettingError(ValueError):
    """A setting is invalid; the message names it, the value and what is accepted."""
