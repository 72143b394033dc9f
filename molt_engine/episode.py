"""The token-first episode record, the one data shape from env to loss, and its collation into padded tensors."""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Episode:
    """Per token: the id, whether the policy generated it (trained) or not (prompt, env feedback), the behaviour
    log-prob recorded at sampling time (0 for non-actions), the policy version that produced it (-1 otherwise), the
    entropy of the distribution it was sampled from (0 for non-actions) and, for MoE policies, the experts
    ([layer][k] ids) that computed its logits at sampling time ([] otherwise)."""
    seed: int
    group: int
    token_ids: list[int] = field(default_factory=list)
    is_action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: list = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    reward: float = 0.0
    images: list = field(default_factory=list)  # pixel values [C, H, W], one per image, in order of their tokens
    info: dict = field(default_factory=dict)  # turns, tool_calls, tool_errors, success, truncated

    def extend(self, ids, *, action=False, logprobs=None, versions=None, experts=None, entropies=None):
        """Tokens that are not sampled here: prompt, env feedback, a forced tool-call opening (never trained), or a
        demonstration's reply (`action`: the warm start's targets, log-prob 0 and version 0 unless given)."""
        self.token_ids += ids
        self.is_action += [action] * len(ids)
        self.logprobs += logprobs or [0.0] * len(ids)
        self.versions += versions or [0 if action else -1] * len(ids)  # a demonstration's: version 0
        self.experts += experts if action and experts else [[]] * len(ids)
        self.entropies += entropies if action and entropies else [0.0] * len(ids)

    def sampled(self, req, n: int | None = None):
        """The one way sampled tokens enter a record, and so the one place that decides what RL trains: the first `n`
        tokens the sampler drew for `req` (all by default; fewer when a stop string ended the reply inside them),
        with the log-prob, version, entropy and experts of each as it was drawn. Nothing else a policy turn adds (a
        forced opening, a stop string's tail, a template's delta) is an action. Only eval episodes decode greedily,
        and they are never trained."""
        self.extend(req.ids[:n], action=True, logprobs=req.logprobs[:n], versions=req.versions[:n],
                    experts=req.experts[:n], entropies=req.entropies[:n])

    @property
    def opens_episode(self) -> bool:
        """False for an agent's later segments: rows of an episode already counted by its first."""
        return not self.info.get("segment")

    @property
    def n_actions(self) -> int:
        return sum(self.is_action)

    @property
    def oldest_version(self) -> int:
        """The staleness of an episode is that of its oldest trained token."""
        return min((v for v, a in zip(self.versions, self.is_action) if a), default=-1)


def collate(episodes: list[Episode], pad_id: int) -> dict:
    """Pad to a batch in which every prompt (the tokens before the first action) ends at column `prompt_width`: left
    padding before it, right padding after the rest of the episode. The rows of a group then agree on all columns
    before that, which token_logprobs computes once per group. Position t of `targets`/`action_mask`/`behav_logp`/
    `versions` is the token predicted by logits at t, i.e. token t+1 of the input; position ids are explicit so
    padding never shifts positions. Images are stacked row-major, the order in which a VLM meets their placeholder
    tokens in the batch."""
    prompts = [e.is_action.index(True) if any(e.is_action) else len(e.token_ids) for e in episodes]
    before, after = max(prompts), max(len(e.token_ids) - p for e, p in zip(episodes, prompts))

    def rows(values, fill):
        return torch.tensor([[fill] * (before - p) + v + [fill] * (after - len(v) + p) for v, p in zip(values, prompts)])

    ids = rows([e.token_ids for e in episodes], pad_id)
    mask = rows([[1] * len(e.token_ids) for e in episodes], 0)
    batch = {
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "targets": ids[:, 1:], "action_mask": rows([e.is_action for e in episodes], False)[:, 1:],
        "behav_logp": rows([e.logprobs for e in episodes], 0.0)[:, 1:].float(),
        "versions": rows([e.versions for e in episodes], -1)[:, 1:], "prompt_width": before,
    }
    recorded = [(i, j, x) for i, e in enumerate(episodes) for j, x in enumerate(e.experts) if x]
    if recorded:
        # MoE: the experts recorded for token j were chosen at input position j-1, whose logits predicted it.
        layers, k = len(recorded[0][2]), len(recorded[0][2][0])
        routes = torch.full(ids.shape + (layers, k), -1, dtype=torch.long)
        for i, j, x in recorded:
            routes[i, before - prompts[i] + j - 1] = torch.tensor(x)
        batch["routes"] = routes
    images = [image for e in episodes for image in e.images]
    if images:
        batch["pixel_values"] = torch.stack(images)
    return batch


def to_device(batch: dict, device) -> dict:
    """A collated batch with its tensors on `device`."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def uncollated(values: torch.Tensor, rows, episodes: list[Episode], prompt_width: int) -> list[list[float | None]]:
    """Per-target values of a collated batch ([B, T-1], e.g. log-probs) back on the tokens of the episodes in `rows`:
    one value per token, None for the first (no logits predict it)."""
    out = []
    for row, e in zip(rows, episodes):
        start = prompt_width - (e.is_action.index(True) if any(e.is_action) else len(e.token_ids))
        out.append([None] + values[row, start:start + len(e.token_ids) - 1].tolist())
    return out


def token_logprobs(model, batch, temperature: float):
    """Log-probs of the targets under `model` at the sampling temperature ([B, T-1]; 0 where no action can be).

    Text-only batches never compute the same thing twice, nor padding that costs more than a forward: identical rows
    (episodes of a group that sampled the same tokens) run once; rows of very different lengths run in chunks of
    similar length (`_length_chunks`), each cut to its longest row; and in a chunk, the columns before the prompts'
    last token, the same in every row of a group, run once per distinct prefix whose keys/values the rows then share.
    Indexing back gives every row its log-probs, and autograd sums the rows' gradients into what they share: the same
    log-probs and gradients as one full forward, for a fraction of the compute. MoE routing replay and VLM images
    address every row and position of the batch, so those batches take the full forward."""
    ids, mask, positions, targets = batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["targets"]
    if "routes" in batch or "pixel_values" in batch:
        images = {"pixel_values": batch["pixel_values"]} if "pixel_values" in batch else {}
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **images).logits
        return _target_logprobs(logits, targets, temperature, model.config)
    first, row = _distinct(torch.cat([ids, mask], 1))
    ids, mask, positions, targets = ids[first], mask[first], positions[first], targets[first]
    split = max(batch["prompt_width"] - 1, 0)  # every target that can be an action is at this column or later
    parts, order = [], []
    for chunk in _length_chunks(lengths := mask[:, split:].sum(1).tolist()):  # each row's columns from the split
        r = torch.tensor(chunk, device=ids.device)
        width, cache = split + max(lengths[i] for i in chunk), None
        if split:
            prefix, prefix_row = _distinct(torch.cat([ids[r, :split], mask[r, :split]], 1))
            cache = model(input_ids=ids[r][prefix, :split], attention_mask=mask[r][prefix, :split],
                          position_ids=positions[r][prefix, :split], use_cache=True, logits_to_keep=1).cache
            cache.batch_select_indices(prefix_row)  # each row gets its prefix's keys/values
        logits = model(input_ids=ids[r, split:width], attention_mask=mask[r, :width],
                       position_ids=positions[r, split:width], cache=cache, use_cache=cache is not None).logits
        logp = _target_logprobs(logits, targets[r, split:width - 1], temperature, model.config)
        parts.append(F.pad(logp, (split, ids.shape[1] - width)))
        order += chunk
    return torch.cat(parts)[torch.tensor(order, device=ids.device).argsort()][row]


def _length_chunks(lengths: list[int], overhead: int = 256) -> list[list[int]]:
    """Rows (indices into `lengths`) in chunks of similar length that compute the fewest positions: a chunk costs its
    rows times its longest length, plus `overhead` positions for the fixed cost of one more forward and backward
    (about what 256 positions of the tiny presets cost on 2 CPU cores). One chunk while padding is cheaper than that."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    starts = [i for i in range(len(order)) if i == 0 or lengths[order[i]] != lengths[order[i - 1]]]
    best = {len(order): (0, [])}  # the chunks from a start to the end: (least cost, chunks)
    for start in reversed(starts):
        best[start] = min((overhead + (end - start) * lengths[order[end - 1]] + best[end][0],
                           [order[start:end]] + best[end][1]) for end in [s for s in starts if s > start] + [len(order)])
    return best[0][1]


def _distinct(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the distinct rows of a 2-D tensor: the index of one occurrence of each, and each row's distinct row."""
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    first = torch.empty(len(distinct), dtype=torch.long).scatter_(0, inverse, torch.arange(len(rows)))
    return first, inverse


def _target_logprobs(logits, targets, temperature: float, config):
    logits = without_placeholder(logits[:, :-1].float() / temperature, config)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def without_placeholder(logits: torch.Tensor, config) -> torch.Tensor:
    """A VLM's image placeholder token is never an action (a generated one would have no image behind it): the
    sampler and the trainer both take it out of the distribution, so their log-probs agree."""
    image_token = getattr(config, "image_token_id", None)
    if image_token is None:
        return logits
    return logits.index_fill(-1, torch.tensor(image_token, device=logits.device), float("-inf"))
