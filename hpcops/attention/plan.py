"""The decode plan: a load-balanced split of the KV tile stream over persistent programs.

Every sequence is cut into 64-token tiles. The tile stream is laid out kv-head-major,
request-minor (all tiles of head 0 for requests 0..B-1, then head 1, ...). A program walks a
contiguous run of it; each maximal run of tiles of one (head, request) inside it is a *task*. A
(head, request) whose tiles span several programs is *split*: its programs write fp32 partial
outputs + log-sum-exp into task-slot-indexed buffers and a combine kernel merges them; an unsplit
one writes the output directly.

The cut is made in *cost*: a tile costs ``unit``, and every (head, request) also costs ``task_cost``
before its first tile (a task's start: the q load, the first tile's latency before the pipeline
fills, the output write). The cost stream is cut into equal buckets of
``bucket = max(ceil(total / num_programs), unit·min_tiles, unit + task_cost)`` units, one per
persistent program; program k runs the tiles that *start* in [k·bucket, (k+1)·bucket). So a program
of many short requests gets fewer tiles than one inside a long request, and no program waits on a
run of tiny tasks while the others idle. ``task_cost`` is in ``TASK_UNITS`` (4) per tile; with
``task_cost = 0`` the unit is the tile and the cut is the plain equal-tile split
``bucket = max(ceil(total / num_programs), min_tiles)``.

Everything the kernels need follows from four numbers and two small tables, computed on the
device in O(B) work by one launch (no host sync, no cross-program waits) into buffers allocated
once for ``max_batch``, so that one decode step (plan + every layer) can be captured in a CUDA graph
and replayed with new lengths:

* ``header`` int32 [5]: bucket (cost units), S (tiles of one kv head = Σ_b T_b), total (cost units:
  Hkv·(unit·S + task_cost·B)), active programs (programs past them hold no tile; a snap can also
  leave some of them empty), the snap the cut used (cost units; int32 max: the whole cut, no request split,
  ``DecodeConfig.split_cost``);
* ``cum`` int32 [max_batch + 1]: prefix sums of T_b = max(1, ceil(L_b / 64));
* ``first_b`` / ``last_b`` int32 [num_programs]: the request holding each program's first / last
  tile (−1 for an idle program);
* ``task_desc`` int32 [num_programs, 8]: where each program starts, so that it needs one load to
  begin (``DecodeConfig.task_desc``): its first request (−1 idle), kv head, first tile inside that
  request, tiles in its bucket and the first request's length (0 idle: the one length a program needs
  before its first tile; the later requests' lengths are read from seq_lens while a task runs);
  columns 5–7 unused;
* ``merge_desc`` int32 [num_programs, 4]: the split (head, request) the combine program k merges
  (the one that starts in bucket k and leaves it): request (−1 none), head, first partial slot,
  number of partials. With ``DecodeConfig.merge_slices`` S > 1, a split of more than 16 partials also
  in the rows of the S − 1 programs after its owner (inside the split, nothing of their own to merge):
  they merge slices of its columns; such a row's owner is first slot // 2.
* ``pair_desc`` int32 [max_batch·num_kv_heads, 4] and ``merge_sem`` int32 [2·num_programs +
  max_batch·num_kv_heads] (``DecodeConfig.tail_merge``): for a split (head h, request b), row h·B + b of
  ``pair_desc`` holds its merge (the program k that owns it, partials, first slot: ``merge_desc`` row k
  seen from the pair; rows of unsplit pairs are stale and never read), and ``merge_sem[2·num_programs +
  h·B + b]`` counts the partials (or, for a long split merged in two levels, the groups) merged so far in
  the current call; ``merge_sem[s]`` counts the partials of the group whose first partial is in slot s.
  The attention program that completes a count merges and sets the count back to 0, so the counts are 0
  between calls (the plan kernel zeroes them too, each step; a plan must not serve two decode calls
  running at once, as its partial buffers already must not).

The two descriptor tables are written (``has_desc``) only when the plan is built with
``DecodeConfig.task_desc`` on, the only config that reads them.

The split partials of program i live in slots 2i (its first task) and 2i+1 (its last task, when
that differs). Without task descriptors (``DecodeConfig.task_desc`` off) the kernels walk the
buckets from the header, in tiles: such a plan is built with ``task_cost = 0``.

The contract: a plan is valid for exactly the ``seq_lens`` it was built from (and its num_kv_heads,
q_len and block_size). The kernels read the lengths from ``seq_lens`` but the tile walk from the
plan, so a plan left over from another step (same batch size, other lengths) gives a wrong result
without an error. Re-plan every decode step, before the layers, with ``plan_decode(seq_lens, ...,
out=plan)``. `decode_attention` always checks num_kv_heads, q_len, block_size, batch size and
device; it recomputes the tables from ``seq_lens`` and compares (`check_plan_matches`) where the
values are checkable: host tensors always, device tensors in checking mode (HPCOPS_CHECK=1, a host
sync per call), never while a CUDA graph is being captured.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

import torch

from hpcops import _platform
from hpcops._checks import check_kernel_device, check_tensor

TILE = 64
MAX_Q_LEN = 8
# Persistent programs per SM and the minimum tiles per program. Defaults from the H200 sweep
# (bench/results/decode_sweep.md): enough programs to keep ~2 tile loads in flight per SM, and a
# floor of 4 tiles (256 tokens) per program so small batches are not over-split.
DEFAULT_PROGRAMS_PER_SM = 2
# the Gluon kernel's plans (`plan_kernel`): ~90 registers a thread leave room for 3 programs an SM, where the
# tail merge wins most (bench/results/decode_tune_tail_h8.md: 4 an SM level or slower outside two cases)
GLUON_PROGRAMS_PER_SM = 3
DEFAULT_MIN_TILES = 4
# The cost the plan charges a task (its start), in TASK_UNITS per tile: 8 = two tiles. From the H200
# tunes (bench/results/decode_tune_task_cost*.md): best or within 3 % in 20 of the 24 decode scenarios;
# 32x0.125K+32x4K h64/8 fp8 goes from 183 to 110 µs (task cost 0 = the equal-tile cut).
TASK_UNITS = 4
DEFAULT_TASK_COST = 8
MAX_TASK_COST = 64
# A cut that would leave at most `snap` cost units of a request on one side of it moves to that
# request's boundary (a split costs a task start, a partial write and a merge). 0 (no snap) from the H200
# tune (bench/results/decode_tune_task_cost_snap.md): geomean 1.026x the per-scenario best against 1.028x
# for 8; 64x4K h8/1 fp8 35.0 against 37.0 µs. 16 fixes 64x0.5K h64/8 but costs the long batches up to 15 %.
DEFAULT_SNAP = 0
# DecodeConfig.split_cost's range (cost units); the snap of a cut that splits no request
MAX_SPLIT_COST = 256
WHOLE_SNAP = 2147483647
# DecodeConfig.split_cost None: by the plan's kernel (the H200 tune at 78dfefb, decode_tune_split_cost.md): the tl
# kernel (combine kernel, 2 programs an SM) gains from whole cuts of short batches (64x0.5K 1.10-1.18x, h64/8 64x4K
# 1.03x); the Gluon kernel (tail merge, 3 an SM) loses (0.87-0.90x), so 0 there. 40 (10 tiles) with the per-SM
# comparison (`whole_pays`): session 49's H100 probe (probe_whole_cut_h100.md) has the whole cut of 8x1K h64/8 bf16
# 1.11x faster (it needs 37 or more) and that of 48x1K h8/1 1.04x slower (45 or more would take it); between the
# two, only 8x1K and 16x2K h64/8 of the bench and grid cases change their cut.
SPLIT_COST_TL = 40
# Not by KV dtype: over fp8 KV with a bf16 q (the tl kernel converts every tile) a lower split cost was tried (tune
# decode's "q16" scenarios, bench/results/decode_tune_q16_40726ce.md): 64x0.5K h8/1 13.8 µs split (split_cost <= 16)
# against 13.6 whole; the static split's 11.7 (decode.md) comes from its kernel, not from its cut (sm_90 builds:
# decode_static_kernel 150 registers, 3 programs an SM; decode_persistent_kernel 189, 2 an SM).
# That split kept the task cost of 8 and the 4-tile floor: uneven pieces of a 40-unit request in 16-unit buckets.
# The tl kernel's tile over fp8 KV under a 16-bit q converts K and V (a dearer tile, ~2x the plain one at 64x0.5K
# h8/1: 13.7 µs whole against ~11.5 over bf16 KV, twice the bytes), so a task start, a split and the tile floor are
# worth fewer tiles there: CONVERT_TILE_COSTS = (min_tiles, task_cost, split_cost), `decode.plan_costs`, where its
# splits merge in the combine kernel. The H100 tunes at dc4b7c9 and e0bb285 (bench/results/decode_tune_cost_scale_
# h100_dc4b7c9.md, decode_tune_cost_defaults_h100_e0bb285.md): 64x0.5K h8/1 13.8 -> 12.5 µs (each request in four
# 2-tile pieces: 9-unit buckets of 36-unit requests; the static split 12.8), the other h8/1 rows of that kind
# 0.97-1.00x (32x0.125K+32x4K 22.8 against 22.1: its 2-tile requests weigh less); at h64/8 (tail merge) task cost 4
# costs the 32x0.125K+32x4K row 22 % (a tail-merged split is a dearer task), so the tail plans keep the defaults.
CONVERT_TILE_COSTS = (2, 4, 16)
# The same tile on a tail plan (h64/8: `decode.plan_tail`), where a split pair's last program merges it: task cost 12
# (three H100 tunes at dc4b7c9, e0bb285 and bb22c71, decode_tune_cost_scale_h100_dc4b7c9.md, _cost_defaults_
# h100_e0bb285.md, _warps_tail_h100_bb22c71.md: 32x0.125K+32x4K h64/8 1.04-1.05x, the other five rows 0.991-1.007x);
# the tile floor and the split cost the defaults'
TAIL_TILE_COSTS = (DEFAULT_MIN_TILES, 12, None)


def whole_pays(total: int, unit: int, bucket: int, whole: int, num_sms: int, split_cost: int) -> bool:
    """Whether the whole cut (buckets of `whole` cost units, no request split) beats the equal cut (buckets of
    `bucket`, the split requests merged after) by the plan's cost model, compared on the busiest SM: the whole
    cut's holds ceil(whole programs / num_sms) whole buckets (a whole pair cannot spread); the equal cut's its
    share of the stream, the larger of a bucket and total / num_sms, plus `split_cost` (partial writes, the
    merge and its wait). So a whole cut that leaves one program an SM where the equal one runs two pays up to
    twice the bucket (16x2K h64/8: 128 whole pairs of 136 units against 132 + 40), and one that would
    leave most SMs idle does not (32x1K h8/1: 32 pairs of 72 against 18 + 40). Session 49's H100 probe
    (bench/results/probe_whole_cut_h100.md) agrees on all its 9 cases."""
    per_sm_whole = whole * -(-((total - unit) // whole + 1) // num_sms)
    per_sm_split = max(bucket, -(-total // num_sms))
    return per_sm_whole <= per_sm_split + split_cost


def split_cost_for(kernel: str, own: int | None = None) -> int:
    """The split cost (cost units) the plan charges for `kernel` ("tl" or "gluon"): DecodeConfig.split_cost, else
    the plan's own (`own`, `DecodePlan.split_cost`: `decode.plan_costs`), else SPLIT_COST_TL for the tl kernel and 0
    (never a whole cut) for the Gluon kernel."""
    from hpcops.attention.decode import decode_config

    asked = decode_config().split_cost
    if asked is not None:
        return asked
    if own is not None:
        return own
    return 0 if kernel == "gluon" else SPLIT_COST_TL


# Launch choices of the plan kernel: DecodeConfig.plan_block_c, plan_warps, plan_block_b
# (hpcops.attention.decode), validated here.
PLAN_BLOCK_C = (0, 16, 32, 64, 128, 256)  # 0: by batch size (`auto_plan_launch`)
PLAN_WARPS = (1, 2, 4, 8)
PLAN_BLOCK_B = (16, 32, 64, 128, 256, 512, 1024)


@dataclass
class DecodePlan:
    """A decode schedule in fixed-capacity device buffers (see the module docstring).

    Build it with `plan_decode`; re-plan a new step into the same buffers with
    ``plan_decode(seq_lens, ..., out=plan)`` (CUDA-graph safe). `batch` is the batch size of the
    last plan (a host int; replays under a graph keep it fixed).

    Valid for exactly the seq_lens it was last planned from (and num_kv_heads, q_len, block_size):
    re-plan every step before the layers. A stale plan gives a wrong result; checking mode
    (HPCOPS_CHECK=1), or seq_lens on the host, makes `decode_attention` raise instead.
    """

    num_kv_heads: int
    q_len: int
    block_size: int
    num_programs: int
    min_tiles: int
    max_batch: int
    batch: int
    header: torch.Tensor
    cum: torch.Tensor
    first_b: torch.Tensor
    last_b: torch.Tensor
    task_desc: torch.Tensor
    merge_desc: torch.Tensor
    pair_desc: torch.Tensor | None = None
    merge_sem: torch.Tensor | None = None
    has_desc: bool = False
    has_pairs: bool = False  # pair_desc written by the last plan (DecodeConfig.tail_merge)
    merge_slices: int = 1  # merge helpers written by the last plan (DecodeConfig.merge_slices; 1: none)
    kernel: str = "tl"  # the attention kernel the plan was built for: "tl" or "gluon" (`decode.plan_kernel`)
    tail: bool = False  # built for the tail merge (`decode.plan_tail`): its pair table written where tail_merge is None
    num_sms: int = _platform.DEFAULT_NUM_SMS  # the SMs its grid runs on (the cost model's `whole_pays`)
    task_cost: int = 0  # as asked; the cut charges it only with descriptors (`cut_task_cost`)
    snap: int = 0  # likewise (`cut_snap`)
    split_cost: int | None = None  # its own split cost (`decode.plan_costs`; None: the kernel's, `split_cost_for`)
    _workspace: dict = field(default_factory=dict, repr=False)

    @property
    def cut_task_cost(self) -> int:
        """The task cost the last plan was cut with: `task_cost` with task descriptors, else 0 (the
        kernels without descriptors walk equal-tile buckets)."""
        return self.task_cost if self.has_desc else 0

    @property
    def cut_snap(self) -> int:
        """The snap the last plan was cut with: `snap` with task descriptors and a task cost, else 0."""
        return self.snap if self.has_desc and self.task_cost else 0

    @property
    def device(self) -> torch.device:
        return self.header.device

    def workspace(self, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial-output and LSE buffers for 2 slots per program, allocated once per shape."""
        key = (rows, head_dim)
        if key not in self._workspace:
            slots = 2 * self.num_programs
            self._workspace[key] = (
                torch.empty((slots, rows, head_dim), dtype=torch.float32, device=self.device),
                torch.empty((slots, rows), dtype=torch.float32, device=self.device),
            )
        return self._workspace[key]

    def host_tables(self) -> dict[str, list[int]]:
        """The plan's tables on the host (syncs; for display and tests)."""
        h = self.header.tolist()
        t = {"header": h[:4], "used_snap": h[4], "cum": self.cum[: self.batch + 1].tolist(),
             "first_b": self.first_b.tolist(), "last_b": self.last_b.tolist()}
        if self.has_desc:
            t.update(task_desc=self.task_desc[:, :5].tolist(), merge_desc=self.merge_desc.tolist())
        return t

    def tasks(self) -> list[tuple[int, int, int, int, int, bool]]:
        """Every task as (program, kv_head, request, first_tile, num_tiles, split) (host-side, syncs)."""
        t = self.host_tables()
        return enumerate_tasks(t["cum"], t["header"], self.num_programs, self.cut_task_cost, t["used_snap"])


def cost_unit(task_cost: int) -> int:
    """Cost units a tile: TASK_UNITS with a task cost, else 1 (the equal-tile cut, in tiles)."""
    return TASK_UNITS if task_cost else 1


class CostStream:
    """The plan's cut in pure Python, with the plan kernel's integer arithmetic: `cum` the request tile
    prefix sums [B + 1] (B ≥ 1), `task_cost` in TASK_UNITS a tile, `bucket` and `snap` in cost units (`snap`
    as the cut used it: `cut` clamps the asked one, WHOLE_SNAP moves every cut to a request boundary)."""

    def __init__(self, cum: list[int], num_kv_heads: int, task_cost: int, bucket: int, snap: int = 0):
        self.cum, self.nb = list(cum), len(cum) - 1
        self.s = self.cum[-1]
        self.unit = cost_unit(task_cost)
        self.cost = task_cost
        self.s_cost = self.unit * self.s + task_cost * self.nb
        self.total = num_kv_heads * self.s_cost
        self.bucket = bucket
        self.snap = snap
        self.active = (self.total - self.unit) // bucket + 1  # programs past these hold no tile
        # where each request's first tile starts in one head's cost stream
        self._starts = [self.unit * self.cum[b] + task_cost * (b + 1) for b in range(self.nb)]

    @classmethod
    def cut(cls, cum: list[int], num_kv_heads: int, task_cost: int, num_programs: int, min_tiles: int,
            snap: int = 0, split_cost: int = 0, *, num_sms: int) -> CostStream:
        """The plan's cut for `num_programs` programs on `num_sms` SMs: the bucket (cost units) at least
        min_tiles tiles and one tile + one task start, so that every bucket but the last holds the start of a
        tile; the asked snap clamped to a quarter bucket. With `split_cost` (cost units, > 0), the whole cut
        where it costs at most that much more (`whole_pays`): a bucket of whole largest pairs
        (c_max·ceil(bucket / c_max)) and every cut moved to a request boundary (`DecodeConfig.split_cost`)."""
        unit = cost_unit(task_cost)
        total = num_kv_heads * (unit * cum[-1] + task_cost * (len(cum) - 1))
        bucket = max(-(-total // num_programs), unit * min_tiles, unit + task_cost)
        c_max = unit * max(b - a for a, b in zip(cum, cum[1:])) + task_cost
        whole = c_max * -(-bucket // c_max)
        if split_cost and whole_pays(total, unit, bucket, whole, num_sms, split_cost):
            return cls(cum, num_kv_heads, task_cost, whole, WHOLE_SNAP)
        return cls(cum, num_kv_heads, task_cost, bucket, min(snap, bucket // 4))

    def tiles_before(self, x: int) -> int:
        """Tiles of the whole stream (head-major) that start before cost position x, after the snap: a
        cut that would leave at most `snap` units of a request on one side moves to that request's
        boundary (the nearer one)."""
        h, r = divmod(x, self.s_cost)
        b = bisect.bisect_left(self._starts, r) - 1  # the last request whose first tile starts before r
        if b < 0:
            return h * self.s
        t = self.cum[b + 1] - self.cum[b]
        before = min(-(-(r - self._starts[b]) // self.unit), t)
        if 0 < before < t:
            if before * self.unit <= self.snap and before <= t - before:
                before = 0
            elif (t - before) * self.unit <= self.snap:
                before = t
        return h * self.s + self.cum[b] + before

    def program_range(self, k: int) -> tuple[int, int]:
        """Program k's tiles [g0, g1) of the whole stream (empty past the active programs, and where
        a snap closed it)."""
        return (self.tiles_before(min(k * self.bucket, self.total)),
                self.tiles_before(min((k + 1) * self.bucket, self.total)))

    def locate(self, g: int) -> tuple[int, int, int]:
        """(kv head, request, tile in the request) of stream tile g."""
        h, r = divmod(g, self.s)
        b = bisect.bisect_right(self.cum, r) - 1
        return h, b, r - self.cum[b]


def enumerate_tasks(cum: list[int], header: list[int], num_programs: int, task_cost: int = 0, snap: int = 0):
    """Walk the plan the way the persistent kernel does (pure Python): every task as (program, kv_head,
    request, first_tile, num_tiles, split). `cum` and `header` are the plan's host tables, `snap` the one its
    cut used (`host_tables()["used_snap"]`)."""
    bucket, s, total, active = header
    if len(cum) < 2 or not total:
        return []
    s_cost = cost_unit(task_cost) * s + task_cost * (len(cum) - 1)
    cs = CostStream(cum, total // s_cost, task_cost, bucket, snap)
    out = []
    for prog in range(min(active, num_programs)):
        g, g1 = cs.program_range(prog)
        while g < g1:
            h, b, j = cs.locate(g)
            t = cs.cum[b + 1] - cs.cum[b]
            n = min(g1 - g, t - j)
            out.append((prog, h, b, j, n, n < t))
            g += n
    return out


def default_num_programs(q_len: int = 1, device: torch.device | str | None = None,
                         programs_per_sm: int | None = None) -> int:
    per_sm = programs_per_sm or int(os.environ.get("HPCOPS_DECODE_PROGRAMS_PER_SM", DEFAULT_PROGRAMS_PER_SM))
    return max(1, per_sm * _platform.num_sms(device))


def _validate_plan_args(seq_lens, num_kv_heads, q_len, block_size, max_batch, task_cost=None, snap=None,
                        num_sms=None):
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    if not isinstance(q_len, int) or not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"q_len must be an int in 1..{MAX_Q_LEN}, got {q_len!r}")
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1) or block_size > 256:
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size!r}")
    if task_cost is not None and (type(task_cost) is not int or not 0 <= task_cost <= MAX_TASK_COST):
        raise ValueError(f"task_cost must be an int in 0..{MAX_TASK_COST} (quarters of a tile), got {task_cost!r}")
    if snap is not None and (type(snap) is not int or not 0 <= snap <= MAX_TASK_COST):
        raise ValueError(f"snap must be an int in 0..{MAX_TASK_COST} (quarters of a tile), got {snap!r}")
    if num_sms is not None and (type(num_sms) is not int or num_sms < 1):
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    if max_batch is not None and seq_lens.shape[0] > max_batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} requests, more than the plan's max_batch={max_batch}")


def plan_decode(seq_lens: torch.Tensor, *, num_kv_heads: int, q_len: int = 1, block_size: int = 64,
                max_batch: int | None = None, max_seq_len: int | None = None, num_programs: int | None = None,
                min_tiles: int | None = None, task_cost: int | None = None, snap: int | None = None,
                out: DecodePlan | None = None, num_q_heads: int | None = None, head_dim: int | None = None,
                q_dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                num_sms: int | None = None) -> DecodePlan:
    """Compute the load-balanced decode schedule for one step on the device.

    The plan is valid for exactly these `seq_lens` (and num_kv_heads, q_len, block_size): call this
    every decode step, before the layers (`out=` reuses the buffers), and pass the same `seq_lens`
    to `decode_attention`. A stale plan is caught only where seq_lens' values are checkable (host
    tensors, or HPCOPS_CHECK=1 on a GPU); elsewhere it gives a wrong result.

    Args:
        seq_lens: int32 `[B]`, KV length of each request including its new tokens (0 = padding).
        num_kv_heads: KV heads of the layer (the plan is shared by all layers of a step).
        q_len: query tokens per request (1..8; speculative decode > 1).
        block_size: KV page size (validated here; `decode_attention` checks it against the cache's).
        max_batch: capacity of the plan's buffers (default: B); re-plan with `out=`.
        max_seq_len: the longest `seq_lens` value the plan will serve (tokens; this step's longest, or a capacity
            such as a model's context): a hint, never checked (a wrong one costs speed, not correctness). Told
            with the hints below, a step of short requests keeps the Gluon kernel's tail merge where a pair
            gathers many partials (h8/1; `decode.plan_tail`); untold, such plans take the combine kernel.
            Buffers do not depend on it. With `out=`, the plan's own.
        num_programs: persistent programs (default: programs-per-SM × SMs).
        min_tiles: minimum 64-token tiles per program (default `DEFAULT_MIN_TILES`, or the hints' tile costs:
            `decode.plan_costs`).
        task_cost: what the cut charges each (head, request) on top of its tiles, in quarters of a
            tile (0..64; default `DEFAULT_TASK_COST`, or the hints' `decode.plan_costs`); applies with task
            descriptors (the default `DecodeConfig.task_desc`). With `out=`, the plan's own.
        snap: a cut that would leave at most this much of a request (quarters of a tile, 0..64;
            default `DEFAULT_SNAP`; with a task cost only) on one side moves to the request's nearer
            boundary instead of splitting it. With `out=`, the plan's own.
        out: an existing plan whose buffers are reused (CUDA-graph replay with new lengths).
        num_q_heads, head_dim, q_dtype, kv_dtype: what the step's `decode_attention` calls take (all four, or
            none). With them the plan picks its kernel (`DecodePlan.kernel`, `decode.plan_kernel`): an fp8 q
            over fp8 KV on an sm_90 GPU, 2–16 q rows a kv head (q_len·G), head_dim 64/128/256 and pages the
            Hopper kernel reads take the Gluon kernel (the H200 bench: h8/1 fp8 1.39× FlashInfer against
            1.32× for the `tl` kernel, h64/8 fp8 15–23 % faster; bench/results/README.md), with the tail
            merge and 3 programs an SM where a pair gathers few partials or `max_seq_len` is short, else
            with the combine kernel and 2 (`decode.plan_tail`, `plan_programs_per_sm`); anything else, or no
            hints, the `tl` kernel with 2. With `out=`, the plan's own. `DecodeConfig.gluon` False keeps every
            plan on the `tl` kernel.
        num_sms: the SMs the attention grid runs on, which the cost model weighs a whole cut by (`whole_pays`;
            default: the device's, `DEFAULT_NUM_SMS` off a GPU). With `out=`, the plan's own.
    """
    _validate_plan_args(seq_lens, num_kv_heads, q_len, block_size, out.max_batch if out is not None else max_batch,
                        task_cost, snap, num_sms)
    check_kernel_device("seq_lens", seq_lens)
    if out is not None:
        if (num_kv_heads, q_len, block_size) != (out.num_kv_heads, out.q_len, out.block_size):
            raise ValueError("out= plan was built for (num_kv_heads, q_len, block_size) = "
                             f"{(out.num_kv_heads, out.q_len, out.block_size)}, got "
                             f"{(num_kv_heads, q_len, block_size)}")
        if seq_lens.device != out.device:
            raise ValueError(f"seq_lens is on {seq_lens.device} but the plan's buffers are on {out.device}")
        plan = out
        plan.batch = seq_lens.shape[0]
    else:
        from hpcops.attention.decode import plan_defaults, plan_kernel

        dev = seq_lens.device
        cap = max(max_batch or seq_lens.shape[0], 1)
        kernel = plan_kernel(num_kv_heads, q_len, block_size, dev, num_q_heads=num_q_heads, head_dim=head_dim,
                             q_dtype=q_dtype, kv_dtype=kv_dtype)
        c, tail, mt0, tc0, sc0 = plan_defaults(kernel, num_kv_heads, q_len, dev, num_programs=num_programs,
                                               num_q_heads=num_q_heads, head_dim=head_dim, q_dtype=q_dtype,
                                               kv_dtype=kv_dtype, max_seq_len=max_seq_len)
        plan = DecodePlan(
            kernel=kernel, tail=tail, num_sms=num_sms or _platform.num_sms(dev), num_kv_heads=num_kv_heads, q_len=q_len,
            block_size=block_size, num_programs=c,
            min_tiles=max(1, min_tiles if min_tiles is not None else mt0), max_batch=cap,
            batch=seq_lens.shape[0], task_cost=tc0 if task_cost is None else task_cost,
            snap=DEFAULT_SNAP if snap is None else snap, split_cost=sc0,
            header=torch.zeros(5, dtype=torch.int32, device=dev),
            cum=torch.zeros(cap + 1, dtype=torch.int32, device=dev),
            first_b=torch.full((c,), -1, dtype=torch.int32, device=dev),
            last_b=torch.full((c,), -1, dtype=torch.int32, device=dev),
            task_desc=torch.zeros((c, 8), dtype=torch.int32, device=dev),
            merge_desc=torch.zeros((c, 4), dtype=torch.int32, device=dev),
            **pair_buffers(cap, num_kv_heads, c, dev),
        )
    _launch_plan(plan, seq_lens)
    return plan


def pair_buffers(max_batch: int, num_kv_heads: int, num_programs: int, device) -> dict[str, torch.Tensor]:
    """A plan's `pair_desc` and `merge_sem` (zeroed: the tail merge's counts start at 0): the counts of the
    groups (one a partial slot, 2 a program) before those of the pairs."""
    n = max_batch * num_kv_heads
    return {"pair_desc": torch.zeros((n, 4), dtype=torch.int32, device=device),
            "merge_sem": torch.zeros(2 * num_programs + n, dtype=torch.int32, device=device)}


def check_plan_matches(plan: DecodePlan, seq_lens: torch.Tensor) -> None:
    """Raise ValueError unless `plan` holds the tables `plan_decode` builds from `seq_lens` (host int32
    `[plan.batch]`), recomputed by the torch reference builder with the plan's own num_kv_heads,
    programs and tile floor. Syncs when the plan is on a device: checking mode only."""
    from hpcops.attention import reference as ref
    from hpcops.attention.decode import decode_config_changed

    # the split cost of the plan's own kernel (the reference, given no dtype hints, would take the tl kernel's)
    with decode_config_changed(split_cost=split_cost_for(plan.kernel, plan.split_cost)):
        want = ref.plan_decode(seq_lens, num_kv_heads=plan.num_kv_heads, q_len=plan.q_len,
                               block_size=plan.block_size, max_batch=plan.max_batch,
                               num_programs=plan.num_programs, min_tiles=plan.min_tiles, task_cost=plan.task_cost,
                               snap=plan.snap, num_sms=plan.num_sms)
    want.has_desc = plan.has_desc
    want = want.host_tables()
    have = plan.host_tables()
    if have == want:
        return
    tiles = [[b - a for a, b in zip(t["cum"], t["cum"][1:])] for t in (have, want)]
    diff = next((i for i, (x, y) in enumerate(zip(*tiles)) if x != y), None)
    where = (f"request {diff} has {tiles[0][diff]} {TILE}-token tiles in the plan but {tiles[1][diff]} "
             f"for seq_lens[{diff}] = {int(seq_lens[diff])}" if diff is not None
             else "its tables differ from those of these seq_lens")
    raise ValueError(f"plan is stale: it was built for other seq_lens ({where}). A plan is valid for "
                     "exactly the seq_lens it was built from: re-plan every step, before the layers, with "
                     "hpcops.plan_decode(seq_lens, ..., out=plan)")


def _launch_plan(plan: DecodePlan, seq_lens: torch.Tensor) -> None:
    from hpcops.attention._plan_kernels import plan_decode_kernel
    from hpcops.attention.decode import decode_config

    cfg = decode_config()
    b = seq_lens.shape[0]
    plan.has_desc = cfg.task_desc
    plan.has_pairs = cfg.task_desc and (cfg.tail_merge or (cfg.tail_merge is None and plan.tail))
    plan.merge_slices = cfg.merge_slices_used()
    if plan.has_pairs and plan.pair_desc is None:
        raise ValueError("DecodeConfig.tail_merge needs a plan with pair buffers (built by plan_decode)")
    if b == 0:
        plan.header.zero_()
        plan.first_b.fill_(-1)
        plan.last_b.fill_(-1)
        plan.task_desc.zero_()
        plan.task_desc[:, 0] = -1
        plan.merge_desc.zero_()
        plan.merge_desc[:, 0] = -1
        return
    for name, ok in (("plan_block_c", PLAN_BLOCK_C), ("plan_warps", PLAN_WARPS), ("plan_block_b", PLAN_BLOCK_B)):
        if getattr(cfg, name) not in ok:
            raise ValueError(f"DecodeConfig.{name} must be one of {ok}, got {getattr(cfg, name)!r}")
    block_b = min(cfg.plan_block_b, max(16, 1 << (b - 1).bit_length()))
    block_c, warps = (cfg.plan_block_c, cfg.plan_warps) if cfg.plan_block_c else auto_plan_launch(b)
    grid = (triton_cdiv(plan.num_programs, block_c),)
    cost = plan.cut_task_cost
    plan_decode_kernel[grid](
        seq_lens, plan.cum, plan.header, plan.first_b, plan.last_b, plan.task_desc, plan.merge_desc,
        plan.pair_desc if plan.has_pairs else plan.merge_desc, plan.merge_sem if plan.has_pairs else plan.cum,
        b, plan.num_kv_heads, plan.num_programs, plan.min_tiles, cost_unit(cost), cost,
        plan.cut_snap, split_cost_for(plan.kernel, plan.split_cost) if cost else 0, plan.num_sms,
        TILE=TILE, BLOCK_B=block_b, BLOCK_C=block_c, ONE_BLOCK=cfg.plan_one_pass and b <= block_b,
        DESC=cfg.task_desc, PAIRS=plan.has_pairs, SLICES=plan.merge_slices,
        num_warps=warps,
    )


def auto_plan_launch(batch: int) -> tuple[int, int]:
    """(plan entries per plan program, warps) for `DecodeConfig.plan_block_c = 0`: the smallest sm90
    instruction count per plan program (compiled ahead, no spills): 16 entries on 1 warp up to 64
    requests (~580 PTX instructions, no barrier, against ~1370 for 128 entries on 4 warps), 32 on 4
    warps above (~870 at 256 requests, against ~3060). Unmeasured on a GPU: the sweep decides."""
    return (16, 1) if batch <= 64 else (32, 4)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
