"""Checkpoints on disk: written whole or not at all (temp dir + os.replace), a `latest` pointer, pruning to the last K."""
import errno
import os
import shutil
from pathlib import Path

# torch, peft and the models are imported where the weights are: the dashboard finds checkpoints (resolve) without them


def save(root: Path, step: int, model, processor, state: dict, reference=None, weights: dict | None = None,
         drills=None, lora=None) -> Path:
    """Write checkpoint `step-NNNNNN` under root and point `latest` at it (the policy's weights are `weights` if given,
    else `model`'s; with `lora`, the run's model.lora, the adapter of `weights` in peft's format). A crash at any
    moment leaves either the previous complete checkpoint or this one, never a half-written directory under a
    checkpoint's name. `drills`: the run's, for drills.full_disk_at."""
    import torch
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # A copy of the dict: save_pretrained empties the one it is given, and `weights` is still the sampler's.
    if lora:
        _save_adapter(tmp / "policy", weights, lora, model.name_or_path)
    else:
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
    _replace(final, tmp)  # a resumed run may write the same step again
    point_latest(root, final)
    return final


def save_policy(path: Path, model, processor, weights: dict, lora=None):
    """Write `weights` (a state dict of `model`'s architecture) and the processor to `path`, loadable by plain
    transformers; the previous contents are replaced whole. With `lora` (model.lora), `weights` are the LoRA policy's:
    its adapter goes to path/adapter in peft's format (PeftModel.from_pretrained(base, path/adapter) loads it), and the
    merged weights to path unless lora.save_merged is off."""
    from .models import merged
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if lora:
        _save_adapter(tmp / "adapter", weights, lora, model.name_or_path)
    if not lora or lora.save_merged:  # merged is a new dict: save_pretrained empties the one it is given
        model.save_pretrained(tmp, state_dict=merged(weights, lora))
    processor.save_pretrained(tmp)
    _replace(path, tmp)


def point_latest(root: Path, path: Path):
    """Make `latest` name the checkpoint at `path` (atomically, and durably)."""
    tmp = root / f".latest.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(path.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / "latest")


def latest(root: Path) -> Path | None:
    """The checkpoint `latest` points to; if a crash left it dangling, the newest complete one."""
    pointer = root / "latest"
    if pointer.exists() and (root / pointer.read_text().strip() / "state.pt").exists():
        return root / pointer.read_text().strip()
    return done[-1] if (done := complete(root)) else None


def resolve(root: Path, which: int | str) -> Path | None:
    """The complete checkpoint under root at step `which` (a number, or its digits), or the one `latest` points to
    ("latest"); None where there is none."""
    found = latest(root) if which == "latest" else root / f"step-{int(which):06d}"
    return found if found and (found / "state.pt").exists() else None


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under root (written whole: they have their state.pt), oldest first."""
    return [p for p in sorted(root.glob("step-*")) if (p / "state.pt").exists()]


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def load(path: Path, model, reference=None) -> dict:
    """Load weights into `model` (and `reference`) in place; return the training state."""
    import torch

    from . import dist
    if (path / "policy" / "adapter_config.json").exists():  # LoRA: onto this run's base, the one it was trained on
        load_adapter(path / "policy", model)
    else:  # the policy's own class: a causal LM or a vision-language model
        dist.load_weights(model, type(model).from_pretrained(path / "policy", dtype=torch.float32).state_dict())
    if reference is not None:
        reference.load_state_dict(type(reference).from_pretrained(path / "reference", dtype=torch.float32).state_dict())
    # On the CPU whatever device saved it: the optimizer moves its state to its parameters' device on load.
    return torch.load(path / "state.pt", weights_only=False, map_location="cpu")


def load_adapter(path: Path, model):
    """Load the LoRA adapter saved at `path` into `model` (a peft model of the adapter's base) in place."""
    import peft
    from safetensors.torch import load_file

    from . import dist
    base = peft.LoraConfig.from_pretrained(path).base_model_name_or_path
    if base != model.name_or_path:
        raise RuntimeError(f"{path.parent.name}: a LoRA adapter of {base!r}; this run's base model is {model.name_or_path!r}")
    adapter = load_file(path / "adapter_model.safetensors")  # peft's names: without the adapter's
    dist.load_weights(model, {k: adapter.get(k.replace(".default", ""), v) for k, v in dist.full_weights(model).items()})


def _save_adapter(path: Path, weights: dict, lora, base: str):
    """A LoRA policy's adapter in peft's format (PeftModel.from_pretrained(base model, path) loads it): the adapter
    tensors and every bias (lora.bias may train them), named without the adapter's name, and a config naming the layers
    it adapts and its base (model.preset or model.path)."""
    import peft
    from safetensors.torch import save_file
    adapted = sorted({k.removeprefix("base_model.model.").split(".lora_A.")[0] for k in weights if ".lora_A." in k})
    peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=adapted, bias=lora.bias,
                    base_model_name_or_path=base).save_pretrained(path)
    save_file({k.replace(".default", ""): v for k, v in weights.items() if ".lora_" in k or k.endswith(".bias")},
              path / "adapter_model.safetensors")


def prune(root: Path, keep: int):
    """Keep the newest `keep` checkpoints; also sweep temp dirs left by a crash mid-write."""
    for old in [*root.glob(".tmp-step-*"), *sorted(root.glob("step-*"))[:-keep]]:
        shutil.rmtree(old, ignore_errors=True)


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _replace(path: Path, tmp: Path):
    """Put the directory written at `tmp` in the place of `path`, whole."""
    # Synced first: else os.replace can reach the disk before the files' contents do (a power loss, not just a kill).
    for f in filter(Path.is_file, tmp.rglob("*")):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
