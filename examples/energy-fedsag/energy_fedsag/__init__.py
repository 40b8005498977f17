"""Energy-aware FedSAG with EdgeFleet's battery mod, in a Flower app of your own.

EdgeFleet's docs/tutorials/own-flower-app.md walks through it."""
