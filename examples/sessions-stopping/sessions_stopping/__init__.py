"""Sessions, warm start and data-free early stopping, in a Flower app of your own.

EdgeFleet's docs/tutorials/own-flower-app.md walks through it."""
