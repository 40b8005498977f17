"""Attacks for evaluating EdgeFleet's defences (and any Flower app's) in simulation; never
for production.

- :mod:`edgefleet.attacks.updates`: model poisoning as pure NumPy on flat update vectors
  (sign flip, ALIE, IPM);
- :mod:`edgefleet.attacks.data`: data poisoning (label flipping, a pixel-pattern backdoor
  and its attack success rate) on arrays and ``ArrayDataset``;
- :mod:`edgefleet.attacks.collusion`: how colluding devices share their honest updates;
- :mod:`edgefleet.attacks.mods`: :func:`attack_mod`, the model-side attacks as a Flower
  ClientApp mod.
"""

from edgefleet.attacks.collusion import Estimate, FolderBoard, InProcessBoard, estimate
from edgefleet.attacks.data import (
    add_trigger,
    attack_success_rate,
    backdoored,
    flip_labels,
    label_flipped,
    poison,
)
from edgefleet.attacks.mods import KINDS, MOD_KINDS, PARAMS, attack_mod
from edgefleet.attacks.updates import alie, alie_z, ipm, sign_flip

__all__ = [
    "KINDS",
    "MOD_KINDS",
    "PARAMS",
    "Estimate",
    "FolderBoard",
    "InProcessBoard",
    "add_trigger",
    "alie",
    "alie_z",
    "attack_mod",
    "attack_success_rate",
    "backdoored",
    "estimate",
    "flip_labels",
    "ipm",
    "label_flipped",
    "poison",
    "sign_flip",
]
