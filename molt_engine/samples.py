"""The samples the engine records for the viewer: episodes as text pieces with every token's numbers, JSON-ready."""
import base64
import io

import torch
from PIL import Image

from .episode import Episode

THUMBNAIL = 64  # pixels, the longer side


def training_samples(groups: list[list[Episode]], advantages: list[float], trainer_logprobs: dict[int, list],
                     n: int, processor, version: int) -> list[dict]:
    """Records of `n` groups of a trained batch, those with a learning signal (rewards that differ) first.
    `trainer_logprobs` maps the batch index of each episode that went through the training forward to its tokens'
    log-probs under the trainer's weights at the start of the step."""
    first = [sum(map(len, groups[:g])) for g in range(len(groups))]  # each group's first episode in the batch
    chosen = sorted(range(len(groups)), key=lambda g: len({e.reward for e in groups[g]}) == 1)[:n]
    indices = [first[g] + j for g in sorted(chosen) for j in range(len(groups[g]))]
    episodes = [e for g in groups for e in g]
    return [record(episodes[i], processor, version, advantages[i], trainer_logprobs.get(i)) for i in indices]


def record(e: Episode, processor, version: int, advantage: float | None = None,
           trainer_logprobs: list | None = None) -> dict:
    """One episode: its tokens column-wise (id, text piece, action or not, behaviour and trainer log-prob, sampling
    version, entropy), the trainer's version, reward, advantage, turns, tool calls and errors, images as PNG
    thumbnails. trainer_logprobs None: not in the training forward (advantage 0, or an eval episode)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    first_action = e.is_action.index(True) if any(e.is_action) else len(e.token_ids)

    def on_actions(values: list | None) -> list:  # the action tokens' values; None elsewhere (everywhere without any)
        return [v if a else None for v, a in zip(values or [None] * len(e.token_ids), e.is_action)]
    return {"group": e.group, "seed": e.seed, "version": version, "reward": e.reward, "advantage": advantage,
            "success": bool(e.info.get("success")), "turns": e.info.get("turns", 0),
            "tool_calls": e.info.get("tool_calls", 0), "tool_errors": e.info.get("tool_errors", 0),
            "prompt": tokenizer.decode(e.token_ids[:first_action]), "text": tokenizer.decode(e.token_ids),
            "tokens": {"id": e.token_ids, "text": tokenizer.batch_decode([[t] for t in e.token_ids]),
                       "action": e.is_action, "logprob": on_actions(e.logprobs),
                       "trainer_logprob": on_actions(trainer_logprobs), "version": e.versions,
                       "entropy": on_actions(e.entropies)},  # no entropies in episodes of older checkpoints
            "images": [thumbnail(pixels, processor) for pixels in e.images]}


def thumbnail(pixels: torch.Tensor, processor) -> str:
    """A processor's normalized pixel values [C, H, W] back to a small PNG, as a data: URL."""
    image_processor = processor.image_processor
    mean, std = (torch.tensor(v)[:, None, None] for v in (image_processor.image_mean, image_processor.image_std))
    rgb = ((pixels.float() * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    image = Image.fromarray(rgb)
    image.thumbnail((THUMBNAIL, THUMBNAIL))
    png = io.BytesIO()
    image.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
