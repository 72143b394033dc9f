"""The token-first episode record, the one data shape from env to loss, and its collation into padded tensors."""
from dataclasses import dataclass, field

import torch


@dataclass
class Episode:
    """Per token: the id, whether the policy generated it (trained) or not (prompt, env feedback), the behaviour
    log-prob recorded at sampling time (0 for non-actions), the policy version that produced it (-1 otherwise) and, for
    MoE policies, the experts ([layer][k] ids) that computed its logits at sampling time ([] otherwise)."""
    seed: int
    group: int
    token_ids: list[int] = field(default_factory=list)
    is_action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: list = field(default_factory=list)
    reward: float = 0.0
    images: list = field(default_factory=list)  # pixel values [C, H, W], one per image, in order of their tokens
    info: dict = field(default_factory=dict)  # turns, tool_calls, success, truncated

    def extend(self, ids, *, action=False, logprobs=None, versions=None, experts=None):
        self.token_ids += ids
        self.is_action += [action] * len(ids)
        self.logprobs += logprobs if action else [0.0] * len(ids)
        self.versions += versions if action else [-1] * len(ids)
        self.experts += experts if action and experts else [[]] * len(ids)

    @property
    def n_actions(self) -> int:
        return sum(self.is_action)

    @property
    def oldest_version(self) -> int:
        """The staleness of an episode is that of its oldest trained token."""
        return min((v for v, a in zip(self.versions, self.is_action) if a), default=-1)


def collate(episodes: list[Episode], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad to a batch. Position t of `targets`/`action_mask`/`behav_logp`/`versions` is the token predicted by
    logits at t, i.e. token t+1 of the input; position ids are explicit so padding never shifts positions. Images
    are stacked row-major, the order in which a VLM meets their placeholder tokens in the batch."""
    width = max(len(e.token_ids) for e in episodes)
    ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(episodes), width), dtype=torch.long)
    action = torch.zeros((len(episodes), width), dtype=torch.bool)
    behav = torch.zeros((len(episodes), width), dtype=torch.float32)
    versions = torch.full((len(episodes), width), -1, dtype=torch.long)
    for i, e in enumerate(episodes):
        n = len(e.token_ids)
        ids[i, width - n:] = torch.tensor(e.token_ids)
        mask[i, width - n:] = 1
        action[i, width - n:] = torch.tensor(e.is_action)
        behav[i, width - n:] = torch.tensor(e.logprobs, dtype=torch.float32)
        versions[i, width - n:] = torch.tensor(e.versions)
    batch = {
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "targets": ids[:, 1:], "action_mask": action[:, 1:], "behav_logp": behav[:, 1:], "versions": versions[:, 1:],
    }
    recorded = [(i, j, x) for i, e in enumerate(episodes) for j, x in enumerate(e.experts) if x]
    if recorded:
        # MoE: the experts recorded for token j were chosen at input position j-1, whose logits predicted it.
        layers, k = len(recorded[0][2]), len(recorded[0][2][0])
        routes = torch.full((len(episodes), width, layers, k), -1, dtype=torch.long)
        for i, j, x in recorded:
            routes[i, width - len(episodes[i].token_ids) + j - 1] = torch.tensor(x)
        batch["routes"] = routes
    images = [image for e in episodes for image in e.images]
    if images:
        batch["pixel_values"] = torch.stack(images)
    return batch


def token_logprobs(model, batch, temperature: float):
    """Log-probs of the targets under `model` at the sampling temperature ([B, T-1])."""
    images = {"pixel_values": batch["pixel_values"]} if "pixel_values" in batch else {}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], **images).logits[:, :-1].float() / temperature
    logits = without_placeholder(logits, model.config)
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)


def without_placeholder(logits: torch.Tensor, config) -> torch.Tensor:
    """A VLM's image placeholder token is never an action (a generated one would have no image behind it): the
    sampler and the trainer both take it out of the distribution, so their log-probs agree."""
    image_token = getattr(config, "image_token_id", None)
    return logits if image_token is None else logits.index_fill(-1, torch.tensor(image_token), float("-inf"))
