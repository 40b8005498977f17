"""The names in EdgeFleet's messages that a ClientApp writes and the server reads, spelled
once for both sides.

Standard library only, and nothing else imported: a Flower user's ClientApp takes the
client side (``edgefleet.client.mods``) without torch or EdgeFleet's server code.
"""

# A status answer: a "status" MetricRecord (the query handler's, completed by the energy mod)
# and, from the energy mod, a "telemetry" ConfigRecord.
STATUS_RECORD = "status"
DEVICE_ID = "device-id"  # also in every train and evaluate reply's metrics
NUM_PARTITIONS = "num-partitions"  # the partitioning the device's data comes from
PRESENT = "present"  # 0 or 1: in this session
LABELS = "labels"  # the classes of the local data, when the query asks for them
BATTERY_LEVEL = "battery-level"
FEASIBLE = "feasible"  # 0 or 1: the battery covers a round
TELEMETRY_RECORD = "telemetry"
LINK_KBPS = "link-kbps"  # a telemetry value: the declared link rate (node config), kbit/s

# A train reply's battery after paying: a ConfigRecord of BATTERY_LEVEL and FEASIBLE (a
# record of its own, so that Flower's strategies do not average it with the metrics).
ENERGY_RECORD = "energy"

# A train config key of the asynchronous loop (edgefleet.loop.asyncloop): the number of
# train messages it has sent so far. A device sent the same global version twice would
# otherwise draw the same batches (its seed comes from the round) and send the same update.
DISPATCH = "async-dispatch"
