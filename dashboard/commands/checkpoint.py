"""``modscope checkpoint FILE (--run DIR | --snapshot FILE) [--rank R]``: does a saved state dict load the model a
run describes? Reads the file (:func:`read_checkpoint`), the model's tensors from the store
(``Store.checkpoint_tensors``), compares them (dashboard/read/checkpoint_compare.py) and prints the result
(:func:`format_text`). Exit status: 0 when the file restores the model, 1 when it does not (keys missing, shapes
that differ, learned values that live outside every state_dict), 2 when the file or the store cannot be read.

A ``.safetensors`` file is read from its JSON header alone (no torch, no safetensors package, no tensor data).
Anything else is read with ``torch.load(FILE, weights_only=True, map_location="cpu")``, memory-mapped where the
format allows, in a child process (probes/checkpoint_file.py): this process never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from probes.schema import display_path

from ..read.checkpoint_compare import Comparison, FileTensor, KeyComparison, ModelKeys, compare, shape_text
from ..read.run import Run
from .children import python_command
from .findings import FindingsError, open_runs

TORCH_READ_TIMEOUT_S = 600.0  # a torch.save file is memory-mapped: reading its keys takes seconds, not minutes
SHOWN = 20                     # keys listed per section; the rest are counted
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_MAX_HEADER = 100_000_000      # safetensors' own limit on its JSON header


class CheckpointError(Exception):
    """A file that cannot be read as a checkpoint: one line naming it."""


@dataclasses.dataclass(frozen=True)
class CheckpointContents:
    path: Path
    form: str                                  # how it was read, for the header line
    tensors: dict[str, FileTensor]


# ------------------------------------------------------------------------------------------------ reading
def read_checkpoint(path: str | Path) -> CheckpointContents:
    """The keys, shapes and dtypes of the state dict in ``path``. Raises CheckpointError naming the file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file; expected a checkpoint (.pt, .pth, .bin, .ckpt, .safetensors)")
    if path.name.endswith(".index.json"):
        return _read_sharded(path)
    try:
        with path.open("rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if path.suffix == ".safetensors" or _looks_like_safetensors(head, path):
        return CheckpointContents(path, "safetensors", _read_safetensors(path))
    if not head.startswith((b"PK", b"\x80")):         # torch.save writes a zip archive (or, before 1.6, a pickle)
        raise CheckpointError(f"{path}: not a checkpoint: neither a torch.save file (a zip archive or a pickle) nor "
                              "a safetensors file")
    return _read_torch(path)


def _looks_like_safetensors(head: bytes, path: Path) -> bool:
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int(struct.unpack("<Q", head[:8])[0])
    return n < min(_MAX_HEADER, path.stat().st_size)


def _read_safetensors(path: Path) -> dict[str, FileTensor]:
    """The header: 8 bytes of little-endian length, then JSON {name: {dtype, shape, data_offsets}, __metadata__}."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, path.stat().st_size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (its header length {n:,} does not fit)")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
            raise CheckpointError(f"{path}: not a safetensors file (entry {key!r} has no shape)")
        dtype = str(entry.get("dtype"))
        out[str(key)] = FileTensor(tuple(int(d) for d in entry["shape"]), _SAFETENSORS_DTYPES.get(dtype, dtype))
    return out


def _read_sharded(path: Path) -> CheckpointContents:
    """A Hugging Face sharded checkpoint's index (``model.safetensors.index.json``): every shard it names."""
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: not a sharded checkpoint index (no \"weight_map\" object)")
    tensors: dict[str, FileTensor] = {}
    for shard in sorted({str(v) for v in weight_map.values()}):
        tensors.update(read_checkpoint(path.parent / shard).tensors)
    return CheckpointContents(path, f"a sharded checkpoint of {len(set(weight_map.values()))} files", tensors)


def _read_torch(path: Path) -> CheckpointContents:
    """A torch.save file, read by a child process (probes/checkpoint_file.py): torch never enters this one."""
    cmd = python_command("probes.checkpoint_file", [str(path)])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TORCH_READ_TIMEOUT_S, check=False)
        doc = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"{path}: reading it took more than {TORCH_READ_TIMEOUT_S:.0f} s") from None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(f"{path}: could not be read ({last[:200]})")
    if "error" in doc:
        raise CheckpointError(str(doc["error"]))
    tensors = {str(k): FileTensor(None if shape is None else tuple(int(d) for d in shape),
                                  None if dtype is None else str(dtype))
               for k, (shape, dtype) in doc["tensors"].items()}
    return CheckpointContents(path, str(doc["form"]), tensors)


# ------------------------------------------------------------------------------------------------ the model
@dataclasses.dataclass(frozen=True)
class Compared:
    run: Run
    rank: int
    comparison: Comparison


def compare_with_runs(contents: CheckpointContents, runs: Sequence[Run], rank: int | None) -> tuple[Compared, int]:
    """The file against the model of each run (at ``rank``, default each run's lowest): the run whose model it fits
    best (the fewest keys missing or unexpected), and how many runs were compared. Raises FindingsError."""
    best: Compared | None = None
    compared = 0
    ranks_seen: set[int] = set()
    for run in runs:
        ranks = run.ranks()
        ranks_seen.update(ranks)
        r = (min(ranks) if ranks else 0) if rank is None else rank
        if r not in ranks:
            continue
        model = ModelKeys.from_store(run.at(r).checkpoint_tensors(r))
        found = Compared(run, r, compare(model, contents.tensors))
        compared += 1
        if best is None or _misfit(found.comparison) < _misfit(best.comparison):
            best = found
    if best is None:
        raise FindingsError(f"--rank {rank}: no such rank in this run; expected one of "
                            f"{', '.join(str(r) for r in sorted(ranks_seen))}")
    return best, compared


def _misfit(c: Comparison) -> tuple[int, int]:
    k = c.keys
    return (len(k.missing_keys) + len(k.unexpected) + len(k.shapes), -k.matched)


# ------------------------------------------------------------------------------------------------ text
def format_text(contents: CheckpointContents, found: Compared, n_runs: int) -> str:
    c = found.comparison
    run = found.run
    name = run.run_id() or run.label_id()
    model_class = str(run.at(found.rank).overview(found.rank).get("model_class") or "the model")
    of = f" (the best fit of {n_runs} runs)" if n_runs > 1 else ""
    lines = [f"{contents.path}: {contents.form}, {c.n_file:,} keys",
             f"against {model_class.rsplit('.', 1)[-1]} of run {name}{of}, rank {found.rank}: "
             f"{c.n_model:,} state_dict keys"]
    lines += _key_sections(c.keys)
    if c.prefix is not None and c.with_prefix_fixed is not None:
        lines.append(f"prefix {c.prefix.prefix!r}: {c.prefix.describe()}")
        lines.append(f"  fix: {c.prefix.fix()}")
        fixed = c.with_prefix_fixed
        if fixed.loads:
            lines.append("  with the prefix fixed, the file loads every key of the model")
        else:
            lines.append("  with the prefix fixed:")
            lines += ["  " + line for line in _key_sections(fixed)]
    lines += _unheld_section(c)
    lines.append(_verdict(c))
    return "\n".join(lines)


def _key_sections(k: KeyComparison) -> list[str]:
    lines = []
    if k.missing_keys:
        shapes = {key: t.shape for t in k.missing for key in (t.key, *t.aliases)}
        trained = sum(1 for t in k.missing if t.trained)
        lines.append(f"keys the model needs that the file lacks: {len(k.missing_keys):,}"
                     + (f" ({trained:,} trained parameters)" if trained else ""))
        lines += [f"  {key}  {shape_text(shapes.get(key))}" for key in k.missing_keys[:SHOWN]]
        lines += _more(len(k.missing_keys))
    if k.unexpected:
        lines.append(f"keys the file has that the model lacks: {len(k.unexpected):,}")
        lines += [f"  {key}" for key in k.unexpected[:SHOWN]]
        lines += _more(len(k.unexpected))
    if k.shapes:
        lines.append(f"shapes that differ: {len(k.shapes):,}")
        lines += [f"  {s.key}  model {shape_text(s.model_shape)}  file {shape_text(s.file_shape)}"
                  for s in k.shapes[:SHOWN]]
        lines += _more(len(k.shapes))
    if k.tied:
        lines.append(f"tied weights the file holds under one name only: {len(k.tied):,} (their values load; "
                     "load_state_dict(strict=True) still asks for every name)")
        lines += [f"  {t.key}  (as {t.loaded_as})" for t in k.tied[:SHOWN]]
        lines += _more(len(k.tied))
    return lines


def _unheld_section(c: Comparison) -> list[str]:
    lost = c.lost
    if not c.unheld:
        return []
    lines = []
    if lost:
        modules = sorted({u.module_path for u in lost if u.module_path is not None})
        numbers = sum(u.numel for u in lost)
        lines.append(f"weights no file can hold: {len(lost):,} tensors ({numbers:,} numbers)"
                     + (f" in {len(modules):,} unregistered modules" if modules else "")
                     + ": model.state_dict() never sees them, so every checkpoint lacks them and a reload leaves "
                       "them at their initial values; register them (nn.ModuleList / nn.ModuleDict, nn.Parameter)")
        for u in lost[:SHOWN]:
            where = (f"in {display_path(u.module_path)} ({u.module_type}, unregistered)" if u.module_path is not None
                     else "a plain tensor attribute with requires_grad")
            lines.append(f"  {u.path}  {shape_text(u.shape)}  {where}")
        lines += _more(len(lost))
    rest = [u for u in c.unheld if not u.learned]
    if rest:
        lines.append(f"plain tensor attributes in no file: {len(rest):,} (constants the model rebuilds when it is "
                     "made; register_buffer them if they are state)")
        lines += [f"  {u.path}  {shape_text(u.shape)}" for u in rest[:SHOWN]]
        lines += _more(len(rest))
    return lines


def _verdict(c: Comparison) -> str:
    if c.complete:
        return "result: the file loads the model completely" + (
            f" ({len(c.keys.unexpected):,} keys of the file unused: strict=True refuses them)" if c.keys.unexpected
            else "")
    why = []
    if c.keys.missing_keys:
        why.append(f"{len(c.keys.missing_keys):,} keys missing")
    if c.keys.shapes:
        why.append(f"{len(c.keys.shapes):,} shapes differ")
    if c.lost:
        why.append(f"{len(c.lost):,} tensors live outside state_dict()")
    return "result: the file does not restore the model: " + ", ".join(why)


def _more(n: int) -> list[str]:
    return [f"  ... and {n - SHOWN:,} more"] if n > SHOWN else []


def run_checkpoint(file: str, *, run: str | None, snapshot: str | None, rank: int | None) -> tuple[str, int]:
    """The text to print and the exit status. Raises CheckpointError (the file) or FindingsError (the store)."""
    runs = open_runs(run=run, snapshot=snapshot)          # the store first: it is cheap to check
    contents = read_checkpoint(file)
    found, n = compare_with_runs(contents, runs, rank)
    return format_text(contents, found, n), found.comparison.exit_status()


def main(argv: Sequence[str], parser: argparse.ArgumentParser, fail: Callable[[str], NoReturn]) -> int:
    """``modscope checkpoint``: ``parser`` is the command line's (its error form), ``fail`` its one-line exit 2."""
    parser.add_argument("file", metavar="FILE", help="a state dict saved with torch.save (.pt, .pth, .bin), a "
                                                     "checkpoint holding one (Lightning .ckpt, {'model': ...}), a "
                                                     ".safetensors file or a sharded checkpoint's .index.json")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory (the run whose model fits best) or one store file")
    src.add_argument("--snapshot", metavar="FILE", help="a snapshot file")
    parser.add_argument("--rank", type=int, default=None, help="the rank whose model is compared (default: the "
                                                               "lowest)")
    args = parser.parse_args(list(argv))
    try:
        text, status = run_checkpoint(args.file, run=args.run, snapshot=args.snapshot, rank=args.rank)
    except (CheckpointError, FindingsError) as exc:
        fail(str(exc))
    print(text)
    return status
