"""The static-shape decode step: every layer's keys and values in buffers allocated once (rows x positions), and a
decode step over a bucket of their rows (1, 2, 4, ..., 512), captured as a CUDA graph per bucket on CUDA and replayed;
on the CPU the very same step runs without capture. The Sampler keeps its rows, masks, prefills and sampling: only
where the cache lives between steps and how a step runs change."""
import os

import torch
from transformers.cache_utils import Cache, DynamicLayer

BUCKETS = tuple(2**i for i in range(10))  # rows a step runs: the active rows rounded up to one of these


def bucket(rows: int) -> int:
    """The smallest bucket that holds `rows` rows."""
    for size in BUCKETS:
        if size >= rows:
            return size
    raise ValueError(f"{rows} rows are more than the largest decode bucket ({BUCKETS[-1]})")


def positions(longest: int) -> int:
    """Positions per row for a cache of at most `longest` columns: a power of two (at least 64), so that a longer
    request reallocates (and recaptures) seldom."""
    return max(64, 1 << (longest - 1).bit_length())


def free_tokens(device: torch.device, token_bytes: int, share: float = 0.3) -> int:
    """Cache positions in `share` of the device's free memory: the budget when loop.kv_budget_gb is unset. The rest
    stays for the trainer (its optimizer state appears at its first step) and the prefills."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * share / token_bytes)


class StaticLayer(DynamicLayer):
    """One layer's keys and values in buffers [rows, heads, positions, head_dim]: a decode step writes its token at
    the column the `column` tensor holds (the same for every row: the Sampler's rows are left-padded to one length)
    and attends to all positions of the step's first `rows` rows, the mask hiding those not yet written."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.buffers, self.column, self.rows = (keys, values), column, len(keys)
        self.is_initialized = True

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        out = [buffer[:self.rows] for buffer in self.buffers]
        for buffer, new in zip(out, (keys, values)):
            buffer.index_copy_(2, self.column, new)
        return out[0], out[1]


class StaticDecode:
    """The Sampler's decode step on static buffers. `kv_tokens` (rows x positions) sizes the buffers; None: a share of
    the memory free when the sampler first admits requests (after the samplers and the trainer made theirs, an eval's
    sampler sees what the training one took); `capture`: CUDA graphs, one per bucket, sharing one memory pool. A
    published version is loaded into the model's parameters in place (Sampler.step), which the graphs read."""

    def __init__(self, model, kv_tokens: int | None, token_bytes: int, capture: bool):
        self.model, self.kv_tokens, self.token_bytes, self.capture = model, kv_tokens, token_bytes, capture
        text, param = model.config.get_text_config(), next(model.parameters())
        self.heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.layers, self.param, self.length = text.num_hidden_layers, param, 0
        self.graphs, self.pool = {}, None  # bucket -> (graph, its logits)

    def rows(self, longest: int) -> int:
        """Rows the buffers hold when the cache reaches `longest` columns (the largest Request.end): what the sampler
        admits. At least one, so that a request larger than the budget still runs."""
        if self.kv_tokens is None:
            self.kv_tokens = free_tokens(self.param.device, self.token_bytes)
        return max(1, min(BUCKETS[-1], self.kv_tokens // positions(longest)))

    def allocate(self, longest: int, rows: int):
        """Buffers for a cache of up to `longest` columns and `rows` rows; the graphs of the old ones go. Captured:
        as many rows as the budget holds there, so that more rows never recapture; uncaptured (the CPU): the bucket of
        `rows`, as nothing is captured (the budget's rows would be gigabytes of zeros for a CPU test). The Sampler's
        cache holds copies of the rows in use (decode made them): the next step copies them in."""
        self.cache = self.graphs = self.pool = None  # the old buffers and the graphs' pool, freed first
        if self.param.is_cuda:
            torch.cuda.empty_cache()
        self.length = positions(longest)
        rows, p = self.rows(longest) if self.capture else bucket(rows), self.param
        shape = (rows, self.heads, self.length, self.head_dim)
        self.column = torch.zeros(1, dtype=torch.long, device=p.device)
        self.cache = Cache(layers=[StaticLayer(p.new_zeros(shape), p.new_zeros(shape), self.column)
                                   for _ in range(self.layers)])
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=p.device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=p.device)
        self.mask = torch.zeros(rows, 1, 1, self.length, dtype=torch.bool, device=p.device)
        self.graphs, self.pool = {}, None

    def decode(self, cache: Cache, mask: torch.Tensor, last: torch.Tensor, longest: int) -> torch.Tensor:
        """One decode step: `cache` (the Sampler's: rows x T positions, left-padded), `mask` [rows, T + 1] with the new
        position, `last` [rows] the tokens to run; `longest`: the columns the cache reaches before the active
        requests end (their largest Request.end: context + max_tokens, and the padding in the middle of a parked row).
        Returns the logits [rows, vocab]; `cache` then holds views of the buffers, T + 1 positions."""
        rows, width = mask.shape
        if longest > self.length or rows > len(self.ids):
            for layer in cache.layers:  # the rows in use, copied out: the old buffers go before the larger ones exist
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            self.allocate(longest, rows)
        size = bucket(rows)
        for layer, static in zip(cache.layers, self.cache.layers):
            keys, values = static.buffers
            if layer.keys.data_ptr() != keys.data_ptr():  # rows joined, regrouped or recomputed since: copy them in
                keys[:rows, :, :width - 1], values[:rows, :, :width - 1] = layer.keys, layer.values
            static.rows = size
        self.ids[:rows, 0] = last
        self.positions[:rows, 0] = mask.sum(1) - 1
        self.mask[:size] = False
        self.mask[:rows, 0, 0, :width] = mask.bool()
        self.mask[rows:size, 0, 0, 0] = True  # the bucket's spare rows attend to one position: no NaN anywhere
        self.column.fill_(width - 1)
        logits = self.replay(size) if self.capture else self.forward(size)
        for layer, static in zip(cache.layers, self.cache.layers):
            layer.keys, layer.values = (buffer[:rows, :, :width] for buffer in static.buffers)
        return logits[:rows]

    def forward(self, size: int) -> torch.Tensor:
        out = self.model(input_ids=self.ids[:size], attention_mask=self.mask[:size],
                         position_ids=self.positions[:size], cache=self.cache, use_cache=True)
        return out.logits[:, -1]

    def replay(self, size: int) -> torch.Tensor:
        """The bucket's graph, captured at its first use: a warm-up on a side stream (as capture requires), then
        the capture; both write the very keys and values the replay then writes."""
        if size not in self.graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the trainer's thread may use the GPU meanwhile (max_staleness > 0)
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = self.forward(size)
            self.graphs[size], self.pool = (graph, logits), graph.pool()
        graph, logits = self.graphs[size]
        graph.replay()
        return logits
