"""Test probe: records what each process of a real training run does. Not part of the course.

The tests put this folder on PYTHONPATH and set DDP_PROBE_DIR. Python imports
`sitecustomize` at start-up in every process (mp.spawn children, torchrun workers, srun
tasks), so the teaching scripts run unmodified under their real launchers while each
process writes, to DDP_PROBE_DIR/<pid>.jsonl:

- {"event": "init", "rank", "world_size", "backend"}  after init_process_group
- {"event": "batch", "loader", "pass", "indices"}    every batch of sample indices a loader drew
- {"event": "final", "rank", "threads"}  at destroy_process_group; the parameters of the first
                                           optimizer (the model being trained) go to <pid>.params.pt
"""

import json
import os

PROBE_DIR = os.environ.get("DDP_PROBE_DIR")


def _install() -> None:
    import torch
    import torch.distributed as dist
    import torch.utils.data as data

    record_path = os.path.join(PROBE_DIR, f"{os.getpid()}.jsonl")
    optimizers: list = []

    def record(event: dict) -> None:
        with open(record_path, "a") as out:
            out.write(json.dumps(event) + "\n")

    def current_rank() -> int | None:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None

    original_init_pg = dist.init_process_group

    def init_process_group(*args, **kwargs):
        result = original_init_pg(*args, **kwargs)
        record({"event": "init", "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "backend": str(dist.get_backend())})
        return result

    dist.init_process_group = init_process_group

    original_destroy = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        if dist.is_initialized():
            if optimizers:
                params = [p.detach().cpu().clone() for group in optimizers[0].param_groups for p in group["params"]]
                torch.save(params, os.path.join(PROBE_DIR, f"{os.getpid()}.params.pt"))
            record({"event": "final", "rank": dist.get_rank(), "threads": torch.get_num_threads()})
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group

    original_loader_init = data.DataLoader.__init__
    loader_count = [0]

    def loader_init(self, *args, **kwargs):
        original_loader_init(self, *args, **kwargs)
        if self.batch_sampler is not None:  # tag the batch sampler with the loader's creation order
            self.batch_sampler._probe_loader = loader_count[0]
            self.batch_sampler._probe_pass = 0
        loader_count[0] += 1

    data.DataLoader.__init__ = loader_init

    original_batch_iter = data.BatchSampler.__iter__

    def batch_iter(self):
        loader = getattr(self, "_probe_loader", None)
        pass_number = getattr(self, "_probe_pass", 0)
        self._probe_pass = pass_number + 1
        for batch in original_batch_iter(self):
            if loader is not None:
                record({"event": "batch", "loader": loader, "pass": pass_number, "rank": current_rank(),
                        "indices": [int(i) for i in batch]})
            yield batch

    data.BatchSampler.__iter__ = batch_iter

    original_optimizer_init = torch.optim.Optimizer.__init__

    def optimizer_init(self, params, *args, **kwargs):
        params = list(params)  # may be a generator: materialise it once for both uses
        original_optimizer_init(self, params, *args, **kwargs)
        if not optimizers:  # the first optimizer holds the model being trained
            optimizers.append(self)

    torch.optim.Optimizer.__init__ = optimizer_init

if PROBE_DIR:
    _install()
