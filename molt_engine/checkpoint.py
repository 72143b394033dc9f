"""Checkpoints on disk: written whole or not at all (temp dir + os.replace), a `latest` pointer, pruning to the last K."""
import errno
import os
import shutil
from pathlib import Path

import torch

from . import dist


def save(root: Path, step: int, model, processor, state: dict, reference=None, weights: dict | None = None,
         drills=None) -> Path:
    """Write checkpoint `step-NNNNNN` under root and point `latest` at it (the policy's weights are `weights` if given,
    else `model`'s). A crash at any moment leaves either the previous complete checkpoint or this one, never a
    half-written directory under a checkpoint's name. `drills`: the run's, for drills.full_disk_at."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # A copy of the dict: save_pretrained empties the one it is given, and `weights` is still the sampler's.
    model.save_pretrained(tmp / "policy", state_dict=dict(weights) if weights is not None else None)
    processor.save_pretrained(tmp / "policy")  # a tokenizer, or a VLM's processor (tokenizer + image processor)
    marker = root.parent / "drills" / f"full-disk-{step}"  # once per step, as the crash drill
    if drills is not None and step in drills.full_disk_at and not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        raise OSError(errno.ENOSPC, "No space left on device (drill: drills.full_disk_at)", str(tmp))
    if reference is not None:
        reference.save_pretrained(tmp / "reference")
    torch.save(state, tmp / "state.pt")
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)  # a resumed run may write the same step again
    os.replace(tmp, final)
    point_latest(root, final)
    return final


def save_policy(path: Path, model, processor, weights: dict):
    """Write `weights` (a state dict of `model`'s architecture) and the processor to `path`, loadable by plain
    transformers; the previous contents are replaced whole."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=dict(weights))  # a copy: save_pretrained empties the dict it is given
    processor.save_pretrained(tmp)
    _fsync_tree(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def point_latest(root: Path, path: Path):
    """Make `latest` name the checkpoint at `path` (atomically, and durably)."""
    _write_atomically(root / "latest", path.name)


def latest(root: Path) -> Path | None:
    """The checkpoint `latest` points to; if a crash left it dangling, the newest complete one."""
    pointer = root / "latest"
    if pointer.exists() and (root / pointer.read_text().strip() / "state.pt").exists():
        return root / pointer.read_text().strip()
    done = complete(root)
    return done[-1] if done else None


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under root (written whole: they have their state.pt), oldest first."""
    return [p for p in sorted(root.glob("step-*")) if (p / "state.pt").exists()]


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def load(path: Path, model, reference=None) -> dict:
    """Load weights into `model` (and `reference`) in place; return the training state."""
    # The policy's own class: a causal LM or a vision-language model.
    dist.load_weights(model, type(model).from_pretrained(path / "policy", dtype=torch.float32).state_dict())
    if reference is not None:
        reference.load_state_dict(type(reference).from_pretrained(path / "reference", dtype=torch.float32).state_dict())
    # On the CPU whatever device saved it: the optimizer moves its state to its parameters' device on load.
    return torch.load(path / "state.pt", weights_only=False, map_location="cpu")


def prune(root: Path, keep: int):
    """Keep the newest `keep` checkpoints; also sweep temp dirs left by a crash mid-write."""
    for tmp in root.glob(".tmp-step-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _write_atomically(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(path: Path):
    # Without it, os.replace can reach the disk before the files' contents do (a power loss, not just a kill).
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
