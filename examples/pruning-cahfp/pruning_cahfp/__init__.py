"""CA-HFP: devices train a pruned submodel, the server rebuilds it, in a Flower app of your own.

EdgeFleet's docs/tutorials/own-flower-app.md walks through it."""
