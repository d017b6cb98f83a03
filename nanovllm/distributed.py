"""The tensor-parallel group of this process and the collectives the parallel layers run on it.
A process is a rank of at most one group at a time (the ranks of one engine); outside a group
it is rank 0 of 1 and the layers run no collective. NCCL on GPUs, gloo on the CPU."""
import os
import threading

import torch
import torch.distributed as dist

_rank, _world_size = 0, 1


def rank_and_size() -> tuple[int, int]:
    return _rank, _world_size


def torchrun_env() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) when torchrun (or a launcher setting its variables) started
    this process, else None."""
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: cuda:LOCAL_RANK on GPUs (the GPUs a process sees are chosen with
    CUDA_VISIBLE_DEVICES), the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def local_store(world_size: int, port: int = 0) -> dist.TCPStore:
    """The rendezvous of ranks on one host. Rank 0 opens it with port 0, so the OS picks a free
    port (store.port) that it passes to the others."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=port == 0, wait_for_workers=False)


def init(rank: int, world_size: int, device: torch.device, store: dist.Store | None = None) -> None:
    """Joins the group through `store`, or through torchrun's env:// variables without one."""
    global _rank, _world_size
    if abort_pending():
        raise RuntimeError("this process holds the NCCL group of a tensor-parallel engine whose rank failed, and "
                           "aborting it did not finish; start another tensor-parallel engine in a new process")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # "cuda" without an index means this rank's GPU from here on
    rendezvous = dict(store=store) if store is not None else dict(init_method="env://")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None, **rendezvous)
    _rank, _world_size = rank, world_size


# After a rank dies, NCCL's abort stops this rank's waiting kernels at once (the stream drains)
# but may then wait without end to free what the lost rank shared
# (docs/performance.md#tensor-and-data-parallelism). close() waits this long for it, then
# leaves it running in its thread.
ABORT_WAIT_S = 10.0
_abandoned: threading.Thread | None = None


def abort_pending() -> bool:
    """Whether an abort of a failed group still runs in its thread (destroy)."""
    return _abandoned is not None and _abandoned.is_alive()


def destroy(abort: bool = False) -> None:
    """Leaves the group. `abort` after a rank failed: NCCL operations waiting for the lost rank
    would otherwise never finish, and a plain destroy would wait for them."""
    global _rank, _world_size, _abandoned
    if dist.is_initialized() and not abort_pending():
        if abort and dist.get_backend() == "nccl":
            aborting = threading.Thread(target=dist.distributed_c10d._abort_process_group, daemon=True,
                                        name="nanovllm-nccl-abort")
            aborting.start()
            aborting.join(ABORT_WAIT_S)
            _abandoned = aborting if aborting.is_alive() else None
        else:
            dist.destroy_process_group()
    _rank, _world_size = 0, 1


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(x, op=op)
    return x


def gather_to_first(x: torch.Tensor) -> torch.Tensor | None:
    """Every rank's `x` concatenated along the last dimension, on rank 0; None elsewhere."""
    parts = [torch.empty_like(x) for _ in range(_world_size)] if _rank == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1) if parts else None


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    dist.broadcast(x, src=0)
    return x


def broadcast_object(obj):
    """Rank 0's `obj` (picklable) on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
