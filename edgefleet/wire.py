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

# A train reply's metrics. NUM_EXAMPLES is Flower's own weight key (any Flower ClientApp
# sends it); the rest are EdgeFleet's optional enrichments, never required of a reply.
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
ENERGY_SPENT = "energy-spent"  # the round's energy cost (the energy mod writes it)
TRAIN_TIME = "train-time-s"  # the seconds the device says it trained
KEPT_FRACTION = "kept-fraction"  # the share of the model's parameters the submodel kept

# A train message's config and records for sessions (edgefleet.strategies.lrschedule,
# .teacher): the round's client learning rate, and for warm-start mode "continuous" the KL
# weight, the session the teacher belongs to, and the teacher itself (an ArrayRecord beside
# the model, sent once per device and session).
CONFIG_LR = "lr"
CONFIG_KL_LAMBDA = "kl-lambda"
CONFIG_TEACHER_SESSION = "teacher-session"
TEACHER_RECORD = "teacher"

# SCAFFOLD (edgefleet.strategies.scaffold): the ArrayRecord c - c_i in a train message, and
# the reply metric that says the device added it to its gradients.
SCAFFOLD_CORRECTION = "scaffold-correction"
SCAFFOLD_APPLIED = "scaffold-applied"
