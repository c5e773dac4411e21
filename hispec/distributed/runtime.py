"""Running a sharded model: rank 0 leads, the other ranks follow its forward calls.

Rank 0 runs everything hispec runs in one process (the engine, the strategies, the sampler,
the server) on its shard of the model. Each call into the model interface -- ``embed``,
``run_layers``, ``final_logits``, ``exit_logits`` -- first sends a command to the followers
(an int64 header and payload on the CPU control group, the input hidden states on the data
group unless the followers already hold them), then runs on rank 0's shard; the followers run
the same call on theirs, so all ranks meet in the same collectives in the same order. Only rank
0 decides anything (which layers run, which drafts are accepted, which token is sampled): the
followers never see a token choice, so every strategy stays exactly as lossless as in one
process, and the logits rank 0 decides on are the all-gathered full-vocabulary logits.

Each follower keeps its shard of every KV pool rank 0 uses (created, sized and freed by
command) and a copy of the exit heads rank 0 calls (sent once, on first use).

Failure: every collective has a timeout (``comm.py``); an idle leader sends a heartbeat so
followers can tell "idle" from "gone"; when a follower process dies, rank 0 stops with a clear
error (``exit_on_failure``) instead of waiting.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .comm import DEFAULT_TIMEOUT_S, Comm, TensorParallelError, init_group

STOP, NOOP, EMBED, LAYERS, FINAL, EXIT, POOL, FREE, HEAD, GATHER_KV, MOVE_KV = range(11)
HEADER = 8  # op, a, b, c, d, payload length, hidden mode, spare
SEND_DATA, HELD = 0, 1  # where a call's input hidden states come from


# ---- the batch metadata a follower needs -----------------------------------------------------
@dataclass
class _Chunk:
    seq_id: int
    start: int
    num_tokens: int


class _Tables:
    """The two things ``AttentionBatch`` reads from a ``BlockManager``, from rank 0's message."""

    def __init__(self, block_size: int, tables: dict[int, list[int]]) -> None:
        self.block_size, self._tables = block_size, tables

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]


def encode_batch(batch, block_size: int) -> list[int]:
    """``[n, (seq_id, start, num_tokens, table_len, *table, tree_root, num_nodes, *parents) * n]`` of an
    ``AttentionBatch`` (``tree_root`` -1 and no parents for a chain)."""
    out = [len(batch.chunks)]
    for c, slots in zip(batch.chunks, batch.context_slots):
        table = (slots[::block_size] // block_size).tolist()
        tree = [-1, 0] if c.tree is None else [c.tree.root, len(c.tree.parents), *c.tree.parents]
        out += [c.seq_id, c.start, c.num_tokens, len(table)] + table + tree
    return out


def decode_batch(payload: list[int], block_size: int, device):
    from ..cache.kv_cache import AttentionBatch, SeqChunk, TreeLayout

    n, i, chunks, tables = payload[0], 1, [], {}
    for _ in range(n):
        seq_id, start, num, tlen = payload[i:i + 4]
        tables[seq_id] = payload[i + 4:i + 4 + tlen]
        i += 4 + tlen
        root, nodes = payload[i:i + 2]
        tree = TreeLayout(root, tuple(payload[i + 2:i + 2 + nodes])) if root >= 0 else None
        chunks.append(SeqChunk(seq_id, start, num, tree))
        i += 2 + nodes
    return AttentionBatch(chunks, _Tables(block_size, tables), device)


# ---- rank 0 -------------------------------------------------------------------------------------
class LeaderMixin:
    """Rank 0's model: each model call is announced to the followers before it runs."""

    def _tp_init(self, procs: list, exit_on_failure: bool) -> None:
        self._tp_lock = threading.RLock()
        self._tp_held: tuple | None = None  # (tensor, version): the followers hold this tensor too
        self._tp_pool_keys: dict[int, int] = {}
        self._tp_freed: list[int] = []
        self._tp_heads: dict[int, nn.Module] = {}
        self._tp_keys = itertools.count(1)
        self._tp_last_send = time.monotonic()
        self._tp_procs = procs
        self._tp_closed = False
        self.calls: list[tuple] = []  # (kind, start, end, tokens, collectives, bytes) per call, when recording
        self.record_calls = False
        threading.Thread(target=self._tp_heartbeat, daemon=True, name="hispec-tp-heartbeat").start()
        if procs:
            threading.Thread(target=self._tp_watch, args=(exit_on_failure,), daemon=True,
                             name="hispec-tp-watch").start()

    # -- messages --
    def _tp_send(self, op: int, a=0, b=0, c=0, d=0, payload: list[int] | None = None, mode: int = 0) -> None:
        comm: Comm = self.tp
        if self._tp_closed:
            raise TensorParallelError("the tensor-parallel group has been shut down")
        while self._tp_freed and op not in (FREE, STOP):
            self._tp_send(FREE, c=self._tp_freed.pop())
        payload = payload or []
        comm.broadcast_control(torch.tensor([op, a, b, c, d, len(payload), mode, 0], dtype=torch.long))
        if payload:
            comm.broadcast_control(torch.tensor(payload, dtype=torch.long))
        self._tp_last_send = time.monotonic()

    def _tp_hidden(self, h: torch.Tensor) -> int:
        held = self._tp_held
        return HELD if held is not None and held[0] is h and held[1] == h._version else SEND_DATA

    def _tp_send_hidden(self, h: torch.Tensor, mode: int) -> None:
        if mode == SEND_DATA:
            self.tp.broadcast_data(h.contiguous())

    def _tp_hold(self, out: torch.Tensor) -> torch.Tensor:
        self._tp_held = (out, out._version)
        return out

    def _tp_pool(self, pool) -> int:
        key = self._tp_pool_keys.get(id(pool))
        if key is None:
            key = next(self._tp_keys)
            self._tp_pool_keys[id(pool)] = key
            weakref.finalize(pool, self._tp_forget_pool, id(pool), key)
            self._tp_send(POOL, a=pool.num_blocks, b=pool.block_size, c=key)
        return key

    def _tp_forget_pool(self, pool_id: int, key: int) -> None:
        self._tp_pool_keys.pop(pool_id, None)
        self._tp_freed.append(key)  # sent before the next command (never from the collector's thread)

    def _tp_sync_head(self, layer: int, head: nn.Module) -> None:
        if self._tp_heads.get(layer) is head:
            return
        k = -1 if head.vocab_ids is None else head.vocab_ids.numel()
        self._tp_send(HEAD, a=layer, b=k, payload=[] if k < 0 else head.vocab_ids.tolist())
        for name, t in sorted(head.state_dict().items()):
            if name != "vocab_ids":
                self.tp.broadcast_data(t.detach().contiguous())
        self._tp_heads[layer] = head

    def _tp_record(self, kind: str, start: int, end: int, tokens: int, before: dict) -> None:
        if self.record_calls:
            after = self.tp.counter.snapshot()
            n = sum(c for k, (c, _) in after.items() if k != "broadcast") - \
                sum(c for k, (c, _) in before.items() if k != "broadcast")
            nbytes = sum(b for k, (_, b) in after.items() if k != "broadcast") - \
                sum(b for k, (_, b) in before.items() if k != "broadcast")
            self.calls.append((kind, start, end, tokens, n, nbytes))

    # -- the model interface --
    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with self._tp_lock:
            before = self.tp.counter.snapshot()
            self._tp_send(EMBED, d=token_ids.shape[0], payload=token_ids.tolist() + positions.tolist())
            out = self._tp_hold(super().embed(token_ids, positions))
            self._tp_record("embed", 0, 0, token_ids.shape[0], before)
            return out

    def run_layers(self, h, start, end, batch, pool, backend=None):
        with self._tp_lock:
            before = self.tp.counter.snapshot()
            key = self._tp_pool(pool)
            mode = self._tp_hidden(h)
            self._tp_send(LAYERS, a=start, b=end, c=key, d=h.shape[0], payload=encode_batch(batch, pool.block_size),
                          mode=mode)
            self._tp_send_hidden(h, mode)
            out = self._tp_hold(super().run_layers(h, start, end, batch, pool, backend))
            self._tp_record("layers", start, end, h.shape[0], before)
            return out

    def move_kv(self, pool, layer: int, src: list[int], dst: list[int]) -> None:
        with self._tp_lock:
            if layer < self.cfg.num_layers:  # (the followers' pools hold the decoder layers)
                self._tp_send(MOVE_KV, a=layer, c=self._tp_pool(pool), payload=list(src) + list(dst))
            super().move_kv(pool, layer, src, dst)

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        with self._tp_lock:
            before = self.tp.counter.snapshot()
            mode = self._tp_hidden(h)
            self._tp_send(FINAL, d=h.shape[0], mode=mode)
            self._tp_send_hidden(h, mode)
            out = super().final_logits(h)
            self._tp_record("logits", self.cfg.num_layers, self.cfg.num_layers, h.shape[0], before)
            return out

    def exit_logits(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        head = self.exits.get(layer) if layer < self.cfg.num_layers else None
        if head is None:
            return self.final_logits(h)
        with self._tp_lock:
            self._tp_sync_head(layer, head)
            before = self.tp.counter.snapshot()
            mode = self._tp_hidden(h)
            self._tp_send(EXIT, a=layer, d=h.shape[0], mode=mode)
            self._tp_send_hidden(h, mode)
            out = super().exit_logits(h, layer)
            self._tp_record("logits", layer, layer, h.shape[0], before)
            return out

    def gather_kv(self, pool, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full K and V ``[C, num_kv_heads, D]`` of ``slots``, from every rank's shard (checks, tests)."""
        with self._tp_lock:
            key = self._tp_pool(pool)
            self._tp_send(GATHER_KV, a=layer, c=key, payload=slots.tolist())
            return _gather_kv(self, pool, layer, slots)

    # -- lifetime --
    def _tp_heartbeat(self) -> None:
        period = self.tp.timeout_s / 4
        while not self._tp_closed:
            time.sleep(min(period, 5.0))
            if time.monotonic() - self._tp_last_send > period and self._tp_lock.acquire(blocking=False):
                try:
                    if not self._tp_closed:
                        self._tp_send(NOOP)
                except TensorParallelError:
                    return
                finally:
                    self._tp_lock.release()

    def _tp_watch(self, exit_on_failure: bool) -> None:
        from multiprocessing.connection import wait

        procs = {p.sentinel: (r, p) for r, p in enumerate(self._tp_procs, start=1)}
        ready = wait(list(procs))
        if self._tp_closed:
            return
        rank, proc = procs[ready[0]]
        proc.join(1)
        print(f"hispec: error: tensor-parallel rank {rank} exited (exit code {proc.exitcode}); the group cannot "
              "continue without it", file=sys.stderr, flush=True)
        if exit_on_failure:
            os._exit(1)

    def shutdown(self) -> None:
        """Stop the followers (they exit 0) and leave the group; after a failure, end them at once."""
        with self._tp_lock:
            if self._tp_closed:
                return
            broken = self.tp.broken
            if not broken:
                try:
                    self._tp_send(STOP)
                except TensorParallelError:
                    broken = True
            self._tp_closed = True
        for p in self._tp_procs:
            if broken:
                p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
        import torch.distributed as dist
        if dist.is_initialized() and not broken:  # a broken gloo group aborts when destroyed
            dist.destroy_process_group()


def _gather_kv(model, pool, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    comm: Comm = model.tp
    cfg, full = model.cfg, model.full_cfg
    sizes = [(b - a) * cfg.head_dim for a, b in
             (_kv_range(full, comm.world_size, r) for r in range(comm.world_size))]
    k, v = pool.read(layer, slots.to(pool.k[0].device))  # [C, Hkv_local, D]
    k = comm.all_gather_last(k.reshape(k.shape[0], -1), sizes)
    v = comm.all_gather_last(v.reshape(v.shape[0], -1), sizes)
    return k.view(k.shape[0], full.num_kv_heads, -1), v.view(v.shape[0], full.num_kv_heads, -1)


def _kv_range(cfg, world: int, rank: int) -> tuple[int, int]:
    from .comm import split_range
    return split_range(cfg.num_kv_heads, world, rank)


_LEADER_CLASSES: dict[type, type] = {}


def make_leader(model: nn.Module, procs: list, exit_on_failure: bool = False) -> nn.Module:
    """Turn rank 0's sharded model into the leader (in place) and return it."""
    base = type(model)
    if base not in _LEADER_CLASSES:
        _LEADER_CLASSES[base] = type("Leader" + base.__name__, (LeaderMixin, base), {})
    model.__class__ = _LEADER_CLASSES[base]
    model._tp_init(procs, exit_on_failure)
    return model


# ---- ranks 1.. ------------------------------------------------------------------------------
def follow(model: nn.Module, *, fail_after: int | None = None, fail_mode: str = "raise") -> None:
    """Serve rank 0's commands on this rank's shard until it sends STOP."""
    from ..cache.kv_cache import KVPool
    from ..model.exits import ExitHead
    from ..model.fast_path import FUSED

    comm: Comm = model.tp
    cfg = model.cfg
    pools: dict[int, KVPool] = {}
    held: torch.Tensor | None = None
    count = 0
    while True:
        header = comm.broadcast_control(torch.zeros(HEADER, dtype=torch.long)).tolist()
        op, a, b, c, d, n, mode, _ = header
        payload = comm.broadcast_control(torch.zeros(n, dtype=torch.long)).tolist() if n else []
        count += 1
        if fail_after is not None and count > fail_after:
            while fail_mode == "hang":  # alive, but answers nothing
                time.sleep(1)
            raise RuntimeError(f"injected failure after {fail_after} commands (test)")
        if op == STOP:
            return
        if op == NOOP:
            continue
        if op == POOL:
            pools[c] = KVPool(cfg.num_layers, a, b, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)
        elif op == FREE:
            pools.pop(c, None)
        elif op == HEAD:
            vocab = torch.tensor(payload, dtype=torch.long) if b >= 0 else None
            head = ExitHead(model, vocab).to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
            for name, t in sorted(head.state_dict().items()):
                if name != "vocab_ids":
                    comm.broadcast_data(t)
            model.exits[a] = head
        elif op == MOVE_KV:
            model.move_kv(pools[c], a, payload[:len(payload) // 2], payload[len(payload) // 2:])
        elif op == GATHER_KV:
            _gather_kv(model, pools[c], a, torch.tensor(payload, dtype=torch.long))
        else:
            if op == EMBED:
                ids = torch.tensor(payload, dtype=torch.long, device=model.device)
                held = model.embed(ids[:d], ids[d:])
                continue
            h = held if mode == HELD else comm.broadcast_data(
                torch.empty(d, cfg.hidden_size, dtype=model.dtype, device=model.device))
            if op == LAYERS:
                pool = pools[c]
                batch = decode_batch(payload, pool.block_size, model.device)
                held = model.run_layers(h, a, b, batch, pool, FUSED)  # the fused CPU path, as rank 0's runner
            elif op == FINAL:
                model.final_logits(h)
            elif op == EXIT:
                model.exit_logits(h, a)
            else:
                raise TensorParallelError(f"unknown command {op} from rank 0")


# ---- starting a group -------------------------------------------------------------------------
def _rendezvous() -> str:
    """A fresh file for the ranks to meet at (no port to pick, so no race with other processes)."""
    import tempfile

    return "file://" + os.path.join(tempfile.mkdtemp(prefix="hispec-tp-"), "rendezvous")


def rank_device(device: str, rank: int) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda":
        return torch.device("cuda", (d.index or 0) + rank)
    return d


def _follower_main(rank: int, world: int, address: str, path: str, device: str, dtype: str, threads: int | None,
                   timeout_s: float, fail_after: tuple[int, str] | None) -> None:
    from .shard import load_shard

    if threads:
        torch.set_num_threads(threads)
    try:
        dev = rank_device(device, rank)
        comm = init_group(rank, world, address, dev, timeout_s)
        model = load_shard(path, comm, device=dev, dtype=getattr(torch, dtype))
        follow(model, **({"fail_after": fail_after[0], "fail_mode": fail_after[1]} if fail_after else {}))
        # leave the group, then end without the interpreter's exit: C++ threads of the group's
        # transport still joinable when their static owners are destroyed abort the process
        # (SIGABRT, "terminate called without an active exception"): 3 of 5 runs did
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except Exception as e:  # noqa: BLE001 - reported in one line, the group cannot go on
        print(f"hispec: error: tensor-parallel rank {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def start_group(path, world_size: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                threads: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, exit_on_failure: bool = False,
                fail_after: tuple[int, int, str] | None = None) -> nn.Module:
    """Start ranks 1..N-1 as processes, join the group as rank 0, and return rank 0's leader model.

    Each rank loads only its shard of the model folder ``path`` (safetensors). ``fail_after``
    ``(rank, n, "raise" or "hang")`` makes that rank fail (or stop answering) after ``n`` commands
    (tests of the failure path).
    """
    ctx = multiprocessing.get_context("spawn")
    address = _rendezvous()
    import atexit
    import shutil

    atexit.register(shutil.rmtree, os.path.dirname(address.removeprefix("file://")), True)
    dtype_name = str(dtype).removeprefix("torch.")
    procs = []
    for rank in range(1, world_size):
        fa = fail_after[1:] if fail_after and fail_after[0] == rank else None
        p = ctx.Process(target=_follower_main, args=(rank, world_size, address, str(path), device, dtype_name,
                                                      threads, timeout_s, fa), daemon=True,
                        name=f"hispec-tp-rank{rank}")
        p.start()
        procs.append(p)
    from .shard import load_shard

    try:
        dev = rank_device(device, 0)
        comm = init_group(0, world_size, address, dev, timeout_s)
        model = load_shard(path, comm, device=dev, dtype=dtype)
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    return make_leader(model, procs, exit_on_failure)
