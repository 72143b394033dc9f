"""The token-first episode record, the one data shape from env to loss, and its collation into padded tensors."""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .logprobs import Head, without_placeholder  # noqa: F401 (the sampler's, from here)


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
    if recorded := [(i, j, x) for i, e in enumerate(episodes) for j, x in enumerate(e.experts) if x]:
        # MoE: the experts recorded for token j were chosen at input position j-1, whose logits predicted it.
        layers, k = len(recorded[0][2]), len(recorded[0][2][0])
        batch["routes"] = routes = torch.full(ids.shape + (layers, k), -1, dtype=torch.long)
        for i, j, x in recorded:
            routes[i, before - prompts[i] + j - 1] = torch.tensor(x)
    if images := [image for e in episodes for image in e.images]:
        batch["pixel_values"] = torch.stack(images)
    if any("token_advantages" in e.info for e in episodes):  # a distillation teacher's, added to the episode's
        batch["token_adv"] = rows([e.info.get("token_advantages", [0.0] * len(e.token_ids)) for e in episodes],
                                  0.0)[:, 1:].float()
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
    """Log-probs of the action targets under `model` at the sampling temperature ([B, T-1]; 0 at other positions),
    through the LM head in chunks (`logprobs.Head`): only the actions' positions are scored.

    Text-only batches never compute what rows share twice, nor padding that costs more than a forward. The rows of a
    prompt form a prefix tree (rows that sample the same first turn share its tokens, identical episodes all of them),
    packed as one sequence of its distinct tokens in which each token attends to its ancestors only (a 4D mask), at
    its own position: the same log-probs and gradients as one full forward, for a fraction of the compute (autograd
    sums the rows' gradients into what they share). Trees of very different sizes run in chunks of similar size
    (`_length_chunks`). MoE routing replay and VLM images address every row and position of the batch, and attention
    other than SDPA over full causal layers cannot take the mask, so those take the full forward."""
    ids, mask, positions, config = batch["input_ids"], batch["attention_mask"], batch["position_ids"], model.config
    targets = F.pad(batch["targets"], (0, 1))  # one column per input column; the last one's prediction is dropped
    actions, head = F.pad(batch["action_mask"], (0, 1)), Head(model, temperature)
    logp = torch.zeros(ids.shape, device=ids.device)  # column t: the log-prob of token t + 1; actions only
    if "routes" in batch or "pixel_values" in batch or config._attn_implementation != "sdpa" or getattr(
            config, "sliding_window", None):  # a custom 4D mask would also replace the sliding window's
        images = {"pixel_values": batch["pixel_values"]} if "pixel_values" in batch else {}
        states = head.forward(input_ids=ids, attention_mask=mask, position_ids=positions, **images)
        logp[actions] = head.logprobs(states[actions], targets[actions])
        return logp[:, :-1]
    split = max(batch["prompt_width"] - 1, 0)  # every target that can be an action is at this column or later
    rows, row = torch.unique(ids.masked_fill(mask == 0, -1), dim=0, return_inverse=True)  # sorted: sharers adjacent
    real, columns = rows >= 0, torch.arange(ids.shape[1]).to(ids)
    shared = F.pad((rows[1:] != rows[:-1]).int().argmax(1), (1, 0)).tolist()  # columns shared with the row before
    ends, tree, sizes = (real * columns).argmax(1) + 1, [], []  # each distinct row's tree; each tree's node count
    # A tree per prompt, of at most four rows' width (a dense mask's attention grows with its square). A row that
    # starts a tree brings all its tokens as new nodes; any other, those after what it shares with the row before.
    # From here on, shared[i] is the column where row i's new nodes start.
    for i, (n, end) in enumerate(zip(real.sum(1).tolist(), ends.tolist())):
        if not sizes or shared[i] <= split or sizes[-1] + end - shared[i] > 4 * len(columns):
            shared[i], sizes = end - n, sizes + [0]
        sizes[-1], tree = sizes[-1] + end - shared[i], tree + [len(sizes) - 1]
    new = real & (columns >= torch.tensor(shared).to(ids)[:, None])  # where a row leaves its tree's nodes so far
    # Nodes numbered in the order rows create them: a preorder of each tree (the rows are sorted), so a node's subtree
    # runs from it to the last node of the last row through it. A shared token is the node above it.
    node = torch.where(new, new.flatten().cumsum(0).view_as(new) - 1, -1).cummax(0).values.masked_fill(~real, -1)
    stop = node.new_zeros(int(new.sum())).scatter_reduce_(
        0, node[real], node.gather(1, ends[:, None] - 1).expand_as(node)[real] + 1, "amax")
    in_tree, base = torch.tensor(tree).to(ids)[row], F.pad(torch.tensor(sizes).to(ids).cumsum(0), (1, 0))  # tree starts
    slot = (node[row] - base[in_tree][:, None])[:, split:]  # a batch row's tokens' places in its tree's sequence
    tokens, where = rows[new], positions[row.new_empty(len(rows)).scatter_(0, row, torch.arange(len(row)).to(row))][new]
    for chunk in _length_chunks(sizes):
        c, place = torch.tensor(chunk).to(ids), torch.arange(max(sizes[t] for t in chunk)).to(ids)
        grid = (base[c][:, None] + place).clamp(max=len(tokens) - 1)  # each tree's nodes, then padding
        # A query node sees key node k if k <= it < k's subtree's end: its ancestors and itself. Padding sees itself.
        last = torch.where(place < (base[c + 1] - base[c])[:, None], stop[grid] - base[c][:, None], place + 1)
        local = torch.full_like(base, -1).index_put_((c,), torch.arange(len(c)).to(ids))[in_tree]  # row in the chunk
        r = (local >= 0).nonzero()[:, 0]  # the batch rows in this chunk
        low = int(slot[r, 0].min())  # logits only from the split, the first of them at this place
        states = head.forward(input_ids=tokens[grid], position_ids=where[grid], logits_to_keep=len(place) - low,
                              attention_mask=((place <= place[:, None]) & (place[:, None] < last[:, None, :]))[:, None])
        # a node's state predicts each of its rows' own next token: scored at the rows' actions
        i, t = ((slot[r] >= 0) & actions[r, split:]).nonzero(as_tuple=True)
        logp[r[i], split + t] = head.logprobs(states[local[r[i]], slot[r[i], t] - low], targets[r[i], split + t])
    return logp[:, :-1]


def _length_chunks(lengths: list[int], overhead: int = 256) -> list[list[int]]:
    """Rows (indices into `lengths`; here, prefix trees and their sizes) in chunks of similar length that compute the
    fewest positions: a chunk costs its rows times its longest length, plus `overhead` positions for the fixed cost of
    one more forward and backward (about what 256 positions of the tiny presets cost on 2 CPU cores). One chunk while
    padding is cheaper than that."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best = {0: (0, [])}  # the first b rows: (least cost, chunks)
    for b in (i for i in range(1, len(order) + 1) if i == len(order) or lengths[order[i]] != lengths[order[i - 1]]):
        total, a = min((cost + overhead + (b - a) * lengths[order[b - 1]], a) for a, (cost, _) in best.items())
        best[b] = (total, best[a][1] + [order[a:b]])  # one list built per end, not one per candidate
    return best[len(order)][1]
