"""Server checkpoints: everything a killed run needs to go on from its last finished round.

After every round (that is, before the next one is dispatched) the :class:`Checkpointer`
callback writes ``checkpoint.npz`` in the run folder: the global model, the number of the
last finished round, the state of every stateful strategy (selection ages and RNG, SAGA
memory, stopping counters, sessions) through their ``state_dict``, the round loop's device
bindings and recent update norms, Python's global RNG (Flower's node sampling draws from
it), and the run's config with its fingerprint (what :func:`check_resumable` compares).

Format (version :data:`FORMAT`): a NumPy ``.npz`` archive read with ``allow_pickle=False``,
so loading never unpickles and cannot run code. It holds

- ``meta``: UTF-8 JSON (as uint8 bytes) with the format version, the round, the config, and
  the state trees, in which every NumPy array is replaced by ``{"$array": i}`` and every
  tuple by ``{"$tuple": [...]}`` (Python's ``random.getstate()`` is a tuple of ints);
- ``m0``, ``m1``, ...: the model's arrays, in the order of ``meta["model_keys"]``;
  ``s0``, ``s1``, ...: the arrays of the state trees;
- ``checksum``: SHA-256 over ``meta`` and every array's name, dtype, shape and bytes. A file
  whose checksum does not match (edited, truncated, another file renamed) is refused.

The file is written to a temporary name, fsynced and moved into place, so a crash mid-write
leaves the previous checkpoint whole. ``checkpoint.pkl`` (format 1, a pickle, written by
earlier versions) is never loaded: unpickling a file can run any code in it.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import re
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log

from edgefleet.arrays import to_numpy, to_record
from edgefleet.config import DEFAULTS, RESUME_CHANGEABLE, RESUME_OPERATIONAL, RunConfig
from edgefleet.fileio import atomic_write_bytes
from edgefleet.loop.hooks import hooks_of
from edgefleet.loop.roundloop import RoundCallback, RoundResult

FILENAME = "checkpoint.npz"
LEGACY_FILENAME = "checkpoint.pkl"
# 3: the loop state holds the device registry (which device is which) instead of the
# screening bindings, and the wrappers no longer keep node -> device maps of their own.
# 4: the sessions wrapper's state nests its learning-rate schedule and continuous teacher,
# now wrappers of their own (SessionLearningRate, ContinuousTeacher).
FORMAT = 4
_ARRAY, _TUPLE = "$array", "$tuple"


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or does not fit this run; the message says why."""


class ResumeError(CheckpointError):
    """``resume = true`` cannot continue this run; the message says why and what to do."""


@dataclass
class Checkpoint:
    round: int  # the last finished round; the resumed run starts at round + 1
    arrays: dict[str, np.ndarray]  # the global model after that round
    strategy: dict[str, Any]  # strategy.state_dict()
    py_random: Any  # random.getstate()
    loop: dict[str, Any] = field(default_factory=dict)  # RoundLoop.state_dict()
    config: dict[str, Any] = field(default_factory=dict)  # run_identity(cfg)
    extra: dict[str, Any] = field(default_factory=dict)

    def array_record(self) -> ArrayRecord:
        return to_record(self.arrays)


# -- the run's identity ------------------------------------------------------------------


def run_identity(cfg: RunConfig) -> dict[str, Any]:
    """The config keys that define the run: all but where and how long to wait."""
    return {k: v for k, v in cfg.to_dict().items() if k not in RESUME_OPERATIONAL}


def fingerprint(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def config_changes(stored: Mapping[str, Any], cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """key -> (checkpoint's value, this config's value) for every run-defining key that
    differs. A key the checkpoint's version did not have counts at its default."""
    now = run_identity(cfg)
    return {
        k: (stored.get(k, DEFAULTS.get(k)), v)
        for k, v in now.items()
        if stored.get(k, DEFAULTS.get(k)) != v
    }


# -- state trees <-> JSON + arrays --------------------------------------------------------


# The leaves of a state tree (most of its values: ages, counters, the RNG state), stored as
# they are. Checked by exact type before any call, so that a tree of a 1,000-device fleet is
# not a call and a formatted path per number (a checkpoint is written every round).
_PLAIN = (type(None), bool, int, float, str)


def _encode(value: Any, arrays: list[np.ndarray], path: str) -> Any:
    if type(value) in _PLAIN:
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise CheckpointError(f"cannot store an object array at {path}")
        arrays.append(value)
        return {_ARRAY: len(arrays) - 1}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        items = [
            v if type(v) in _PLAIN else _encode(v, arrays, f"{path}[{i}]")
            for i, v in enumerate(value)
        ]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or k.startswith("$"):
                raise CheckpointError(f"cannot store the key {k!r} at {path}: keys are strings")
            out[k] = v if type(v) in _PLAIN else _encode(v, arrays, f"{path}.{k}")
        return out
    raise CheckpointError(f"cannot store a {type(value).__name__} at {path}")


def _decode(value: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if isinstance(value, dict):
        if set(value) == {_ARRAY}:
            index = value[_ARRAY]
            if not isinstance(index, int) or not 0 <= index < len(arrays):
                raise CheckpointError(f"array reference {index!r} out of range")
            return arrays[index]
        if set(value) == {_TUPLE}:
            return tuple(_decode(v, arrays) for v in value[_TUPLE])
        return {k: _decode(v, arrays) for k, v in value.items()}
    return value


def _checksum(meta: bytes, arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256(meta)
    for name, value in arrays.items():
        h.update(f"\0{name}\0{value.dtype.str}\0{list(value.shape)}\0".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def _text(data: bytes | str) -> np.ndarray:
    raw = data.encode() if isinstance(data, str) else data
    return np.frombuffer(raw, dtype=np.uint8)


def dumps(ckpt: Checkpoint) -> bytes:
    """The checkpoint file's bytes."""
    state_arrays: list[np.ndarray] = []
    trees = {
        name: _encode(getattr(ckpt, name), state_arrays, name)
        for name in ("strategy", "py_random", "loop", "extra")
    }
    meta = {
        "format": FORMAT,
        "round": int(ckpt.round),
        "model_keys": list(ckpt.arrays),
        "config": ckpt.config,
        "fingerprint": fingerprint(ckpt.config),
        **trees,
    }
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    arrays = {f"m{i}": np.asarray(v) for i, v in enumerate(ckpt.arrays.values())}
    arrays.update({f"s{i}": v for i, v in enumerate(state_arrays)})
    for name, value in arrays.items():
        if value.dtype.hasobject:
            raise CheckpointError(f"cannot store an object array ({name})")
    buf = io.BytesIO()
    np.savez(
        buf,
        meta=_text(meta_bytes),
        checksum=_text(_checksum(meta_bytes, arrays)),
        **arrays,  # type: ignore[arg-type]
    )
    return buf.getvalue()


def loads(data: bytes, where: str = "checkpoint") -> Checkpoint:
    """Read a checkpoint's bytes; never unpickles. Raises :class:`CheckpointError`.

    Verified before it is parsed: the archive's structure and every array's size first
    (:func:`_read_members`), then the checksum over the metadata's bytes and the arrays, then
    the metadata's nesting depth; only then is the JSON read. A file made to crash a parser
    (an encrypted or compressed member, a header declaring 10^13 elements, JSON nested
    100,000 deep) is a :class:`CheckpointError` saying what is wrong, never a traceback."""
    members = _read_members(data, where)
    meta_raw, stored = members.pop("meta", None), members.pop("checksum", None)
    if meta_raw is None or stored is None or meta_raw.dtype != np.uint8:
        raise CheckpointError(f"{where} is not an EdgeFleet checkpoint (no meta or checksum)")
    meta_bytes = meta_raw.tobytes()
    ordered = {k: members[k] for k in sorted(members, key=_member_order)}
    if stored.tobytes().decode(errors="replace") != _checksum(meta_bytes, ordered):
        raise CheckpointError(f"{where} fails its checksum: it was altered or is damaged")
    depth = _json_depth(meta_bytes)
    if depth > MAX_META_DEPTH:
        raise CheckpointError(
            f"{where}: its metadata nests {depth} levels deep; a checkpoint's nests at most "
            f"{MAX_META_DEPTH}"
        )
    try:
        meta = json.loads(meta_bytes)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{where}: its metadata is not JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        version = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{where} has format {version!r}; this version reads {FORMAT}")
    try:
        keys = [str(k) for k in meta["model_keys"]]
        model = {k: members[f"m{i}"] for i, k in enumerate(keys)}
        state_arrays = [members[f"s{i}"] for i in range(sum(n[0] == "s" for n in members))]
        rnd = meta["round"]
        if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0:
            raise ValueError(f"round {rnd!r}")
        return Checkpoint(
            round=rnd,
            arrays=model,
            strategy=_decode(meta["strategy"], state_arrays),
            py_random=_decode(meta["py_random"], state_arrays),
            loop=_decode(meta["loop"], state_arrays),
            config=dict(meta["config"]),
            extra=_decode(meta["extra"], state_arrays),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where} is malformed: {err!r}") from None


# Bounds on what a checkpoint file may declare, checked before anything is allocated or parsed.
# The deepest state tree EdgeFleet writes nests about a dozen levels (sessions -> learning-rate
# schedule -> teacher -> ...); 64 leaves room for new wrappers and stays far below Python's
# recursion limit, which the JSON reader and _decode would otherwise meet.
MAX_META_DEPTH = 64
# np.savez writes up to two members per array (the model's and the state's): a 100,000-device
# SAGA table is still far below this.
MAX_MEMBERS = 1_000_000
_NPY_HEADER_MAX = 10_000  # numpy's own default bound on an .npy header


def _read_members(data: bytes, where: str) -> dict[str, np.ndarray]:
    """Every ``.npy`` member of the archive, each checked before it is read: stored as
    ``np.savez`` stores it (not encrypted, not compressed: a compressed member could expand
    without bound, and EdgeFleet never writes one), inside the file, no two overlapping, and
    of exactly the bytes its header declares (a header declaring 10^13 elements is refused
    before numpy allocates them). Object (pickled) arrays are refused."""

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{where} is not an EdgeFleet checkpoint ({why})")

    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise refuse(f"not a zip archive: {err}") from None
    members: dict[str, np.ndarray] = {}
    with archive:
        infos = archive.infolist()
        if len(infos) > MAX_MEMBERS:
            raise refuse(f"{len(infos)} members; at most {MAX_MEMBERS}")
        declared = 0
        for info in infos:
            name = info.filename
            if info.flag_bits & 0x1:
                raise refuse(f"member {name[:80]!r} is encrypted")
            if info.compress_type != zipfile.ZIP_STORED:
                raise refuse(
                    f"member {name[:80]!r} is compressed (method {info.compress_type}); "
                    "a checkpoint's members are stored uncompressed"
                )
            if not name.endswith(".npy") or name[:-4] in members:
                raise refuse(f"member {name[:80]!r} is not one array of a checkpoint")
            declared += info.file_size
            if info.file_size != info.compress_size or declared > len(data):
                raise refuse(f"member {name[:80]!r} declares more bytes than the file holds")
            try:
                with archive.open(info) as f:
                    members[name[:-4]] = _read_npy(f, info.file_size, name, refuse)
            except CheckpointError:
                raise
            except (ValueError, OSError, EOFError, KeyError, RuntimeError, NotImplementedError,
                    zipfile.BadZipFile, zlib.error) as err:  # fmt: skip
                raise refuse(f"member {name[:80]!r} cannot be read: {err}") from None
    return members


def _read_npy(f: Any, size: int, name: str, refuse: Callable[[str], CheckpointError]) -> np.ndarray:
    """One ``.npy`` member whose header has been checked against its ``size`` in bytes."""
    from numpy.lib import format as npy

    version = npy.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise refuse(f"member {name[:80]!r} has npy version {version}")
    read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    shape, fortran, dtype = read_header(f, max_header_size=_NPY_HEADER_MAX)
    if dtype.hasobject:
        raise refuse(f"member {name[:80]!r} is an object array, which only a pickle holds")
    count = math.prod(int(n) for n in shape)  # Python ints: no overflow
    header = f.tell()
    if count * dtype.itemsize != size - header:
        raise refuse(
            f"member {name[:80]!r} declares {count} elements of {dtype.itemsize} bytes "
            f"({count * dtype.itemsize} bytes) but holds {size - header}"
        )
    raw = f.read(size - header)
    array = np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return array.copy()  # writable, and no longer tied to the member's buffer


def _json_depth(raw: bytes) -> int:
    """How deep JSON text nests its arrays and objects, measured without parsing it (a
    parser meets Python's recursion limit first). Brackets inside strings do not count."""
    outside = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", raw)
    codes = np.frombuffer(outside, dtype=np.uint8)
    opens = (codes == ord("[")) | (codes == ord("{"))
    closes = (codes == ord("]")) | (codes == ord("}"))
    steps = opens.astype(np.int64) - closes.astype(np.int64)
    return int(np.cumsum(steps).max()) if steps.size else 0


def _member_order(name: str) -> tuple[str, int]:
    # np.savez keeps insertion order, but read back in a fixed one: m0, m1, ..., s0, s1, ...
    return (name[0], int(name[1:]) if name[1:].isdigit() else -1)


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    atomic_write_bytes(path, dumps(ckpt))


def load_checkpoint(path: Path) -> Checkpoint:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {err}") from None
    return loads(data, f"checkpoint {path}")


def checkpointed_round(run_dir: Path) -> int:
    """The last round ``run_dir``'s checkpoint covers, 0 while it has none (or none that
    reads): for watching a run from outside it."""
    try:
        return load_checkpoint(Path(run_dir) / FILENAME).round
    except CheckpointError:
        return 0


# -- writing and resuming -------------------------------------------------------------------


class Checkpointer(RoundCallback):
    """Round callback (put it last): write the checkpoint once the round is recorded.

    ``loop_state`` (the round loop's ``state_dict``) and ``config`` (the run's identity)
    are stored with it when given."""

    def __init__(
        self,
        run_dir: Path,
        strategy: Any,
        config: Mapping[str, Any] | None = None,
        loop_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.path = run_dir / FILENAME
        self.strategy = strategy
        self.config = dict(config or {})
        self.loop_state = loop_state

    def after_round(self, result: RoundResult) -> str | None:
        # After a rolled-back round result.arrays is the model from before it: a non-finite
        # model never reaches a checkpoint.
        self.save(result.round, result.arrays)
        return None

    def save(self, last_round: int, arrays: ArrayRecord) -> None:
        """Checkpoint now: ``arrays`` is the model after ``last_round`` (the asynchronous
        loop also calls this between versions, with its buffer in the loop state)."""
        state = hooks_of(self.strategy).state_dict()
        ckpt = Checkpoint(
            last_round,
            to_numpy(arrays),
            state,
            random.getstate(),
            loop=self.loop_state() if self.loop_state else {},
            config=self.config,
        )
        save_checkpoint(self.path, ckpt)


def apply_checkpoint(ckpt: Checkpoint, strategy: Any, keys: list[str], loop: Any = None) -> None:
    """Load ``ckpt`` into ``strategy``, ``loop`` (a RoundLoop) and Python's RNG.

    ``keys`` are the model's array names: a checkpoint of another model is refused rather
    than half-loaded."""
    if set(ckpt.arrays) != set(keys):
        raise CheckpointError(
            f"the checkpoint is of another model: its arrays are "
            f"{sorted(ckpt.arrays)[:4]}..., this run's are {sorted(keys)[:4]}..."
        )
    try:
        hooks_of(strategy).load_state_dict(ckpt.strategy)
        if loop is not None:
            loop.load_state_dict(ckpt.loop)
        random.setstate(ckpt.py_random)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        raise CheckpointError(
            f"the checkpoint's state does not fit this run's strategy: {err!r}"
        ) from None


def check_resumable(cfg: RunConfig, run_dir: Path) -> Checkpoint:
    """The checkpoint to continue ``run_dir`` from under ``cfg``, or :class:`ResumeError`
    saying why that would not continue the same run (README "Crash and resume"):

    - no such run, or a run without a finished round: refused (check ``run-name``);
    - rows but no checkpoint, or only an old pickle checkpoint: refused (continuing would
      repeat rounds, and a pickle is never loaded);
    - a run-defining key changed: refused, naming each key with both values; the keys of
      ``RESUME_CHANGEABLE`` may change when ``resume-changes`` names them;
    - a finished run (``summary.json``): refused unless ``num-server-rounds`` grew (then the
      extra rounds run);
    - a checkpoint past ``num-server-rounds``: refused.
    """
    name = run_dir.name
    ckpt_path, rows = run_dir / FILENAME, run_dir / "metrics.jsonl"
    if not ckpt_path.exists():
        if (run_dir / LEGACY_FILENAME).exists():
            raise ResumeError(
                f"run {name} has only {LEGACY_FILENAME}, the pickle checkpoint of an older "
                "EdgeFleet: it is not loaded, because unpickling a file can run any code in "
                "it. Start the run again under a new run-name."
            )
        if rows.exists():
            raise ResumeError(
                f"run {name} has rows in {rows} but no checkpoint: continuing would repeat "
                "rounds already on record. Start it again under a new run-name (or remove "
                f"{run_dir})."
            )
        parent = run_dir.parent
        others = (
            sorted(p.name for p in parent.iterdir() if p.is_dir())[:10] if parent.is_dir() else []
        )
        where = f"; runs there: {', '.join(others)}" if others else ""
        raise ResumeError(
            f"resume = true, but there is no run {name!r} with a finished round in "
            f"{parent}{where}. Check run-name, or leave out resume to start the run."
        )
    ckpt = load_checkpoint(ckpt_path)
    changes = config_changes(ckpt.config, cfg)
    allowed = set(cfg.server.resume_changes)
    refused = {k: v for k, v in changes.items() if k not in allowed}
    if refused:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(refused.items()))
        changeable = sorted(set(refused) & set(RESUME_CHANGEABLE))
        hint = (
            f" To change {', '.join(changeable)}, name it in resume-changes." if changeable else ""
        )
        raise ResumeError(
            f"run {name} was started with another config, so resuming would not continue the "
            f"same run: {listed}.{hint} The other keys define the run: start a new run-name "
            "to change them."
        )
    for key in sorted(set(changes) & allowed):
        old, new = changes[key]
        log(WARNING, "Resuming run %s with %s changed: %r -> %r", name, key, old, new)
    rounds = cfg.server.num_rounds
    if (run_dir / "summary.json").exists():
        before = ckpt.config.get("num-server-rounds", ckpt.round)
        if rounds <= max(before, ckpt.round):
            raise ResumeError(
                f"run {name} has finished (round {ckpt.round} of {before}); nothing to "
                f"resume. To run more rounds, resume with num-server-rounds > {before} and "
                "resume-changes = 'num-server-rounds'."
            )
    if ckpt.round > rounds:
        raise ResumeError(
            f"run {name}'s checkpoint is at round {ckpt.round}, past num-server-rounds = {rounds}."
        )
    return ckpt
