"""The sampler: KV-cache decoding batched across all episodes (a row per distinct sequence), stamping logprob and version;
its decode steps eager, or on static buffers as CUDA graphs (static.py)."""
import asyncio
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from ..episode import without_placeholder
from ..models import routers
from .static import StaticDecode


class RoomyLayer(DynamicLayer):
    """A cache layer with room to grow: `keys`/`values` are the front of buffers with 32 positions to spare, so a
    decode step writes its token in place where DynamicLayer's cat copied every row's whole cache, in every layer,
    at every step. Rows regrouped or joined go straight into new room (Sampler._regroup, _join); keys/values assigned
    otherwise (the rows a weight swap recomputes) get new room at the next update. The spare positions are outside
    the KV budget's books (loop.kv_budget_gb): 32 positions a row at most."""

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        n, end = (self.keys.shape[-2] if self.is_initialized else 0), keys.shape[-2]
        if n and self.room[0].data_ptr() == self.keys.data_ptr() and self.room[0].shape[-2] >= n + end:
            self.room[0][:, :, n:n + end], self.room[1][:, :, n:n + end] = keys, values
        else:  # new room: what the layer holds, then the new positions, then the spare ones
            self.room = [torch.cat([*([old] if n else []), new, new.new_empty(*new.shape[:-2], 32, new.shape[-1])], -2)
                         for old, new in ((self.keys, keys), (self.values, values))]
            self.is_initialized, self.device = True, keys.device
        self.keys, self.values = (x[:, :, :n + end] for x in self.room)
        return self.keys, self.values


def decoding(model, cuda_graphs: bool | str) -> str:
    """Which path decodes (loop.cuda_graphs): "CUDA graphs" for a dense text model on CUDA, "static shapes" (the same
    step without capture) when `cuda_graphs` is "uncaptured" or the environment has MOLT_STATIC_DECODE=1 (CI's second
    pass of the rollout tests, so that the CPU runs the graphs' step), else "eager": the CPU, MoE and VLM policies."""
    if routers(model) or model.config.get_text_config() is not model.config:
        return "eager"
    if cuda_graphs == "uncaptured" or os.environ.get("MOLT_STATIC_DECODE") == "1":
        return "static shapes"
    if not cuda_graphs:
        return "eager"
    return "CUDA graphs" if next(model.parameters()).device.type == "cuda" else "eager"


@dataclass
class Request:
    context: list[int]            # the whole episode so far: prompt, earlier actions, env feedback
    max_tokens: int
    greedy: bool
    seed: int                     # with the count of tokens sampled, its random numbers (see Sampler._sample)
    images: list = field(default_factory=list)  # pixel values of the context's images, in order (VLMs only)
    future: asyncio.Future | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: list = field(default_factory=list)  # MoE: per token, the [layer][k] experts that computed its logits
    entropies: list[float] = field(default_factory=list)  # per generated token: the behaviour policy's entropy
    top: int = 0                  # alternatives to record per generated token (an agent's top_logprobs)
    top_logprobs: list = field(default_factory=list)  # per generated token: the `top` most likely (id, log-prob)
    row: int = -1                 # its row of the sampler's KV cache, shared by requests whose tokens are all equal
    # The columns its row spans (first used one to the last) once max_tokens are sampled, padding in the middle of a
    # parked row included: the cache's width never passes the largest `end` of its rows (see Sampler._admit).
    end: int = 0

    @property
    def cancelled(self) -> bool:
        """Its caller gave up (an episode cut off by its timeout, the run's end): nothing more is decoded for it."""
        return self.future is not None and self.future.cancelled()


class Sampler:
    # A published version waits up to this many decode steps for the active rows to end their turns (their tokens keep
    # the version that computed them) before the rest are recomputed: a swap into an empty cache recomputes nothing
    # (docs/benchmarks.md, eighteenth pass).
    swap_wait = 12

    def __init__(self, model, stop_ids: list[int], pad_id: int, temperature: float, version: int = 0,
                 kv_budget_gb: float | None = None, executor=None, cuda_graphs: bool | str = False,
                 kv_planned_gb: float | None = None):
        self.model, self.device, self.routers = model.eval(), next(model.parameters()).device, routers(model)
        text = model.config.get_text_config()
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        token_bytes = 2 * text.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()
        # The budget as cache positions (rows x columns): keys and values of every layer, in the weights' dtype.
        self.kv_tokens = None if kv_budget_gb is None else int(kv_budget_gb * 1e9 / token_bytes)
        self.decoding, self.static = decoding(model, cuda_graphs), None
        if self.decoding != "eager":  # static buffers sized by the budget, else the memory plan's KV share (loop.py),
            planned = None if kv_planned_gb is None else int(kv_planned_gb * 1e9 / token_bytes)  # else free memory
            self.static = StaticDecode(model, planned if self.kv_tokens is None else self.kv_tokens, token_bytes,
                                       capture=self.decoding == "CUDA graphs")
        self.stop_ids = set(stop_ids)  # a request ends at any of these: eos ids, a chat template's end of turn
        self.pad_id, self.temperature, self.version, self.waited = pad_id, temperature, version, 0
        self.pending: list[Request] = []   # submitted, joins the batch at the next step
        # generate() and publish() run on the event loop's thread while a step runs on another (run): the lock hands
        # pending requests and published weights over, so that none is lost between a step's read and its write.
        self.handoff = threading.Lock()
        self.awaited: dict[int, Request] = {}  # id -> a request its caller awaits (generate): a failed step fails it
        self.active: list[Request] = []    # in generation, each on a row of the cache
        self.cache = None                  # RoomyLayers, one row per distinct sequence of the active requests, left-padded
        self.mask = None                   # [rows, T] attention mask of the cache
        self.last = None                   # [rows] each row's last sampled token: the next decode step's input
        self.new_weights = None            # (state_dict, version) published by the trainer
        # Finished requests' keys/values, by the tokens they hold (context + ids[:-1]), kept for the episode's next turn
        # to start from: {tokens: (mask row, [2 x layers, heads, tokens, head_dim]: each layer's keys, then values,
        # the columns the row spans)}.
        # Only this version's: a swap empties it.
        self.parked: dict[tuple, tuple] = {}
        self.wake = asyncio.Event()
        self.executor = executor  # where decode steps run (on-policy: the updates' thread); None: asyncio's
        self.stats = {"steps": 0, "rows": 0, "busy_s": 0.0, "idle_s": 0.0, "tokens": 0}

    def publish(self, state_dict, version: int):
        """Called by the trainer; the swap happens between decode steps, never inside one."""
        with self.handoff:
            self.new_weights = (state_dict, version)
        self.wake.set()

    async def generate(self, context, max_tokens, *, images=(), greedy=False, seed=0, top=0) -> Request:
        req = Request(list(context), max_tokens, greedy, seed, list(images), top=top)
        req.future = asyncio.get_running_loop().create_future()
        with self.handoff:
            self.pending.append(req)
        self.awaited[id(req)] = req
        self.wake.set()
        try:
            return await req.future
        finally:
            del self.awaited[id(req)]

    async def run(self):
        """The sampler coroutine: heavy work goes to a thread so envs and the trainer keep running."""
        while True:
            t0 = time.perf_counter()
            if not (self.pending or self.active):
                self.wake.clear()
                await self.wake.wait()
                self.stats["idle_s"] += time.perf_counter() - t0
                continue
            try:
                finished = await asyncio.get_running_loop().run_in_executor(self.executor, self.step)
            except Exception as error:  # its requests (joining ones too) would wait forever: they fail with it
                for req in self.awaited.values():
                    if not req.future.done():
                        req.future.set_exception(error)
                raise
            self.stats["busy_s"] += time.perf_counter() - t0
            for req in finished:
                if not req.future.done():  # its episode may have been cancelled
                    req.future.set_result(req)

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One decode step: swap weights if published (once the active rows ended their turns, or `swap_wait` steps
        on), decode one token for every cache row, prefill joining requests (while rows decode, at every 4th step and
        never while a swap waits), then regroup the rows. Returns the finished requests. Cancelled requests leave
        first: their rows, and the KV budget they held, are free for this step."""
        if any(r.cancelled for r in self.active):
            self._regroup([r for r in self.active if not r.cancelled])
        self.waited += self.new_weights is not None
        with self.handoff:
            swap = self.new_weights is not None and (not self.active or self.waited > self.swap_wait)
            if swap:
                (state_dict, self.version), self.new_weights, self.waited = self.new_weights, None, 0
            pending, self.pending = self.pending, []
        if swap:
            # Eager steps on weights of its own dtype and device, tied as its own are (one tensor per tied group):
            # decode on the published tensors themselves (never changed in place: each version is a new copy), not
            # on a copy of them. The static path's steps (CUDA graphs) read the parameters where they were captured.
            mine, param = self.model.state_dict(), next(self.model.parameters())
            pairs = {(mine[k].data_ptr(), v.data_ptr()) for k, v in state_dict.items()}
            shared = (self.static is None and len(pairs) == len(dict(pairs)) == len({b for _, b in pairs})
                      and all(v.dtype == param.dtype and v.device == param.device
                              for v in state_dict.values() if v.is_floating_point()))
            self.model.load_state_dict(state_dict, assign=shared)
            self.parked.clear()
            if self.active:
                # The cache holds keys/values of the old weights: recompute it, so that every token's log-prob is
                # exactly that of the version it is tagged with (what the trainer's recomputation will check).
                owners = [r for _, r in sorted({r.row: r for r in self.active}.items())]  # one request per row
                self.cache, mask, _, _, row = self._prefill(owners, [r.context + r.ids[:-1] for r in owners])
                self.cache.batch_select_indices(row)
                self.mask = mask[row]
                for r in self.active:  # their rows now hold no padding in the middle
                    r.end = len(r.context) + r.max_tokens
        # While rows decode, requests join at every 4th step only: a join (its prefill, and the merge into the cache)
        # costs about two decode steps whatever its size, so fewer, larger joins leave more of the sampler to decoding.
        # While a swap waits they do not join at all: the cache then empties sooner, and they join the new version.
        if self.active and (self.stats["steps"] % 4 or self.new_weights):
            joining, waiting = [], pending
        else:
            joining, waiting = self._admit(pending)
        with self.handoff:
            self.pending[:0] = waiting  # ahead of those submitted during this step
        if self.active:
            self.mask = F.pad(self.mask, (0, 1), value=1)
            if self.static:
                logits = self.static.decode(self.cache, self.mask, self.last, max(r.end for r in self.active))
            else:
                out = self.model(input_ids=self.last[:, None], attention_mask=self.mask,
                                 position_ids=self.mask.sum(1, keepdim=True) - 1, cache=self.cache, use_cache=True)
                self.cache, logits = out.cache, out.logits[:, -1]
            self._sample(self.active, logits, self._last_routes(len(self.mask)))
        if joining:
            self._join(joining)
        self.stats["steps"] += 1
        self.stats["rows"] += len(self.active)
        done = [r.ids[-1] in self.stop_ids or len(r.ids) >= r.max_tokens for r in self.active]
        finished = [r for r, d in zip(self.active, done) if d]
        # A multi-turn episode's next context starts with what a finished request holds: park its row, so that turn
        # prefills only the new tokens. Not under a KV budget (parked rows are outside its books), nor with images.
        park = [r for r in finished if not r.images and self.kv_tokens is None]
        if park:
            rows = torch.tensor([r.row for r in park], device=self.device)
            kv = torch.stack([x[rows] for layer in self.cache.layers for x in (layer.keys, layer.values)], 1)
            for r, mask, keys_values in zip(park, self.mask[rows], kv):
                # the columns its row spans: its end less the tokens it did not sample and the last one (not run)
                span = r.end - r.max_tokens + len(r.ids) - 1
                self.parked.setdefault(tuple(r.context + r.ids[:-1]), (mask, keys_values, span))
        self._regroup([r for r, d in zip(self.active, done) if not d])
        return finished

    def _admit(self, pending: list[Request]) -> tuple[list[Request], list[Request]]:
        """Of the `pending` requests, those that join now and those that wait, in submission order: the cache is rows x
        its width, so with every row counted at the width it reaches (its `end`: context + max_tokens; a turn that
        starts from a parked row also counts the padding that the longest prompt joining beside it puts in the row's
        middle) the joined ones never grow it past the KV budget (static buffers: no more rows than they hold at that
        width). One request always runs, so a request larger than the budget still finishes."""
        pending = [r for r in pending if not r.cancelled]
        if self.kv_tokens is None and self.static is None:
            return pending, []
        # parked: the largest span + max_tokens of the joining requests that start from a parked row
        longest, new, parked = max((r.end for r in self.active), default=0), 0, None
        for i, req in enumerate(pending):
            found = self._parked(req)
            new = max(new, len(req.context) - (found[0] if found else 0))  # the prefill's width past the parked columns
            if found:
                parked = max(parked or 0, found[3] + req.max_tokens)
            else:
                longest = max(longest, len(req.context) + req.max_tokens)
            longest = max(longest, parked + new if parked else 0)
            rows = len(self.active) + i + 1
            if rows > 1 and (rows > self.static.rows(longest) if self.static else rows * longest > self.kv_tokens):
                return pending[:i], pending[i:]
        return pending, []

    def _last_routes(self, rows: int) -> list | None:
        """MoE: the experts each row's last position went through in the forward just run ([rows][layers][k])."""
        if not self.routers:
            return None
        return torch.stack([r.selected.view(rows, -1, r.top_k)[:, -1] for r in self.routers], 1).tolist()

    def _sample(self, reqs: list[Request], logits: torch.Tensor, routes: list | None):
        """Inverse-CDF sampling over the whole batch at once: a request's k-th token is where its k-th uniform number
        falls in the cumulative probabilities. That number is a hash (splitmix64) of the request's seed and k, so a
        sample never depends on the rest of the batch, on which requests share its cache row, nor on the device; and
        it is one op for all requests, where a noise generator per request cost a call each (most of the sampling's
        time at a small vocabulary). `logits` and `routes` are per row."""
        rows = torch.tensor([req.row for req in reqs], device=self.device)
        logp = torch.log_softmax(without_placeholder(logits[rows].float() / self.temperature, self.model.config), -1)
        probs = logp.exp()
        entropy = torch.special.entr(probs).sum(-1)
        # splitmix64 of (seed, tokens sampled so far): int64 products wrap as uint64 ones do; a mask makes >> logical
        x = torch.tensor([(r.seed * 0x9E3779B97F4A7C15 + len(r.ids)) % 2**64 - 2**63 for r in reqs], device=self.device)
        for shift, factor in ((30, 0xBF58476D1CE4E5B9 - 2**64), (27, 0x94D049BB133111EB - 2**64), (31, 1)):
            x = (x ^ ((x >> shift) & ((1 << 64 - shift) - 1))) * factor  # the last round has no multiply: 1
        u = ((x >> 11) & (2**53 - 1)).double() * 2.0**-53  # its top 53 bits: uniform in [0, 1)
        cdf = probs.double().cumsum(-1)
        # the point stays under the total: rounded up to it, it would pass the last token of nonzero probability
        point = torch.minimum(u * cdf[:, -1], cdf[:, -1].nextafter(torch.zeros_like(u)))
        sampled = torch.searchsorted(cdf, point[:, None], right=True)[:, 0]  # first token whose cdf passes the point
        tokens = torch.where(torch.tensor([req.greedy for req in reqs], device=self.device), logp.argmax(-1), sampled)
        chosen = logp.gather(-1, tokens[:, None])[:, 0]
        # one host synchronisation for the step's results (float64 holds every token id and float32 value exactly)
        tokens, chosen, entropy = torch.stack([tokens.double(), chosen.double(), entropy.double()]).tolist()
        for i, (req, token, lp, h) in enumerate(zip(reqs, tokens, chosen, entropy)):
            req.ids.append(int(token))
            req.logprobs.append(lp)
            req.versions.append(self.version)
            req.entropies.append(h)
            if routes:
                req.experts.append(routes[req.row])
            if req.top:
                values, ids = logp[i].topk(req.top)
                req.top_logprobs.append(list(zip(ids.tolist(), values.tolist())))
        self.stats["tokens"] += len(reqs)

    def _prefill(self, reqs: list[Request], seqs: list[list[int]], parked: list | None = None):
        """Run sequences (seqs[i] is reqs[i]'s) as one left-padded batch: the cache, attention mask, last-position
        logits and (MoE) experts of its rows, and each sequence's row. Identical text-only sequences (a group's
        shared prompt, the same tool call made by several of its episodes) run once. The requests' images go in
        row-major order, the order of their placeholder tokens; decode steps need none. `parked[i]`: (n, mask row,
        keys/values) of seqs[i]'s first n tokens, from the episode's previous turn; only the rest runs, after them."""
        parked, images = parked or [None] * len(reqs), [image for r in reqs for image in r.images]
        # A row per distinct key (the sequence and its parked length; with images, every sequence is its own), in
        # first-seen order, running the sequence of the first request with that key
        keys = [(tuple(s), i if images else 0, p[0] if p else 0) for i, (s, p) in enumerate(zip(seqs, parked))]
        owners = sorted({key: i for i, key in reversed(list(enumerate(keys)))}.values())
        slot = {keys[i]: n for n, i in enumerate(owners)}  # distinct key -> its row
        row = torch.tensor([slot[key] for key in keys], device=self.device)
        new = [seqs[i][parked[i][0] if parked[i] else 0:] for i in owners]  # the tokens each row still runs
        width = max(len(s) for s in new)
        ids = torch.tensor([[self.pad_id] * (width - len(s)) + s for s in new], device=self.device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in new], device=self.device)
        kept = max((len(parked[i][1]) for i in owners if parked[i]), default=0)
        cache = Cache(layer_class_to_replicate=RoomyLayer)
        if kept:  # the parked rows first, left-padded to the longest; a row without one has only padding there
            some = next(parked[i] for i in owners if parked[i])
            rows = [parked[i] or (0, some[1][:0], some[2][:, :, :0]) for i in owners]
            kv = torch.stack([F.pad(p[2], (0, 0, kept - len(p[1]), 0)) for p in rows])  # [rows, 2 x layers, ...]
            for layer in range(kv.shape[1] // 2):
                cache.update(kv[:, 2 * layer], kv[:, 2 * layer + 1], layer)
            mask = torch.cat([torch.stack([F.pad(p[1], (kept - len(p[1]), 0)) for p in rows]), mask], 1)
        pixels = {"pixel_values": torch.stack(images).to(self.device)} if images else {}
        out = self.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1,
                         position_ids=(mask.cumsum(1) - 1).clamp(min=0)[:, kept:], **pixels)
        return out.cache, mask, out.logits[:, -1], self._last_routes(len(owners)), row

    def _parked(self, req: Request) -> tuple | None:
        """(n, mask row, keys/values, span) of the longest parked sequence that `req`'s context starts with (its
        episode's previous turn), if any."""
        if req.images:
            return None
        lengths = sorted({len(key) for key in self.parked}, reverse=True)
        return next(((n, *self.parked[key]) for n in lengths if n < len(req.context) and
                     (key := tuple(req.context[:n])) in self.parked), None)

    def _join(self, reqs: list[Request]):
        """Prefill the new requests, sample their first token, append their rows to the running cache. A request
        whose context starts with a parked sequence (its episode's previous turn) starts from that sequence's keys and
        values, the longest such one, and prefills only the rest."""
        parked = [self._parked(r) for r in reqs]
        cache, mask, logits, routes, row = self._prefill(reqs, [r.context for r in reqs], parked)
        new = max(len(r.context) - (p[0] if p else 0) for r, p in zip(reqs, parked))
        for req, p, i in zip(reqs, parked, row.tolist()):
            # a parked row: its parked columns, then padding up to the longest prompt beside it, then its new tokens
            req.row, req.end = i, (p[3] + new if p else len(req.context)) + req.max_tokens
        self._sample(reqs, logits, routes)
        if not self.active:
            self.active, self.cache, self.mask = reqs, cache, mask
            return
        for req in reqs:
            req.row += len(self.mask)
        # Left-pad the shorter of the two caches so both have the same length, then stack the rows.
        total, n = max(old_len := self.mask.shape[1], new_len := mask.shape[1]), len(self.mask)
        for old, new in zip(self.cache.layers, cache.layers):  # into new room, as _regroup does
            old.room = [x.new_zeros(n + len(mask), x.shape[1], total + 32, x.shape[3]) for x in (old.keys, old.values)]
            for room, a, b in zip(old.room, (old.keys, old.values), (new.keys, new.values)):
                room[:n, :, total - old_len:total], room[n:, :, total - new_len:total] = a, b
            old.keys, old.values = (room[:, :, :total] for room in old.room)
        self.mask = torch.cat([F.pad(self.mask, (total - old_len, 0)), F.pad(mask, (total - new_len, 0))])
        self.active = self.active + reqs

    def _regroup(self, keep: list[Request]):
        """Requests on one cache row have the same tokens so far; those that sampled the same next token still do and
        keep sharing a row (a group's episodes often generate the very same tool call), the others get a copy of the
        row each. Finished requests leave; rows no request uses go, with the leading columns only padding uses."""
        if not keep:
            self.active, self.cache, self.mask = [], None, None
            return
        rows = {}  # (old row, token) -> new row
        for req in keep:
            req.row = rows.setdefault((req.row, req.ids[-1]), len(rows))
        self.active, self.last = keep, torch.tensor([token for _, token in rows], device=self.device)
        parent = [row for row, _ in rows]
        mask = self.mask[parent]
        start = int((mask.sum(0) > 0).nonzero()[0])
        if parent == list(range(len(self.mask))) and start == 0:
            return  # nothing diverged, finished or emptied: the cache stays as it is
        index, width = torch.tensor(parent, device=self.device), mask.shape[1] - start
        for layer in self.cache.layers:  # straight into new room, where the next decode step writes (RoomyLayer)
            layer.room = [x.new_empty(len(parent), x.shape[1], width + 32, x.shape[3])
                          for x in (layer.keys, layer.values)]
            layer.keys, layer.values = [torch.index_select(x[:, :, start:], 0, index, out=room[:, :, :width])
                                        for x, room in zip((layer.keys, layer.values), layer.room)]
        self.mask = mask[:, start:]
