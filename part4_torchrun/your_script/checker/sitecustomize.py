"""The recording half of ddp_check.py: what each process of a DDP run did, for any script.

Python imports a module named `sitecustomize` at start-up, from the first folder on its path that
has one. `ddp_check.py` puts this folder first on PYTHONPATH and names a folder in DDP_CHECK_DIR,
so every process of the run (each torchrun worker, each srun task) loads it, and the script runs
unchanged. The hooks go in right after the process imports torch. Each process appends JSON lines
to DDP_CHECK_DIR/<pid>.jsonl, one per event; every line has "event", "rank" (the process group's,
else the launcher's RANK, else None) and "time":

- init        {world_size, backend}               after init_process_group
- wrap        {model, module}                     a DistributedDataParallel is made; `model`
                                                  numbers them in this process
- forward     {model, training, shapes, digest, rows, pass}   each call of a DDP-wrapped
              module: training = the module is in train mode and gradients are on; digest = a
              hash of all its tensor arguments; rows = a hash of each row (dim 0) of the first
              tensor argument with 2 or more dimensions, else of the whole first tensor (at most
              MAX_ROWS per call); pass = [loader, pass] of the last batch a loader handed out in
              this process (None without one): which epoch the input belongs to
- batch       {loader, sampler, dataset, pass, samples}   each batch a map-style DataLoader's
              batch sampler hands out, as indices into the underlying data set (through Subsets)
- collective  {name, file, line, forwards}        the script calls a torch.distributed
              collective (recorded before the call: a call that never returns is recorded too);
              file:line is the first caller outside torch; forwards = training forwards so far
- end         {model, params, buffers, saved}     at destroy_process_group, else at exit: a hash
              of each parameter and buffer of each wrapped module; the parameters themselves go
              to the file `saved`
- exit        {}                                  Python shuts down normally

Another sitecustomize further along the path (a site's own, or the course's test probe) is
loaded after this one, so both work.
"""

import atexit
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import weakref

CHECK_DIR = os.environ.get("DDP_CHECK_DIR")
HERE = os.path.dirname(os.path.abspath(__file__))
MAX_ROWS = 1024
COLLECTIVES = (
    *("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all"),
    *("all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list"),
    *("gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter"),
    "scatter_object_list",
)
_out = {"pid": None, "file": None}


def record(event: str, **fields) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None
    if _out["pid"] != os.getpid():
        # first record of this process (or of a forked child): a file of its own
        _out["pid"] = os.getpid()
        os.makedirs(CHECK_DIR, exist_ok=True)
        _out["file"] = open(os.path.join(CHECK_DIR, f"{os.getpid()}.jsonl"), "a")  # noqa: SIM115
    line = json.dumps({"event": event, "rank": rank, "time": time.time(), **fields})
    _out["file"].write(line + "\n")
    _out["file"].flush()


def as_bytes(tensor):
    """The tensor's values as a 2-D uint8 numpy array, one row per element of dim 0."""
    import torch

    flat = tensor.detach().to("cpu").contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    rows = flat.shape[0] if flat.dim() else 1
    if flat.numel() == 0:
        return torch.zeros(rows, 0, dtype=torch.uint8).numpy()
    return flat.reshape(rows, -1).view(torch.uint8).numpy()


def digest(*chunks: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def tensor_digest(tensor) -> str:
    return digest(str(tensor.dtype).encode(), str(tuple(tensor.shape)).encode(), as_bytes(tensor))


def tensors_in(value) -> list:
    """The tensors in a forward's arguments, in order, through lists, tuples and dicts."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def row_digests(tensors: list) -> list[str]:
    first = next((t for t in tensors if t.dim() >= 2), None)
    if first is None:
        return [tensor_digest(tensors[0])] if tensors else []
    rows = as_bytes(first[:MAX_ROWS])
    kind = f"{first.dtype}{tuple(first.shape[1:])}".encode()
    return [digest(kind, row.tobytes()) for row in rows]


def caller() -> tuple[str, int]:
    """The first frame outside torch and the recorders (this file, another sitecustomize that
    wraps the same function): the script's line that made the call."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    frame = sys._getframe(2)
    while frame and (
        frame.f_code.co_filename.startswith(torch_dir)
        or os.path.basename(frame.f_code.co_filename) == "sitecustomize.py"
    ):
        frame = frame.f_back
    if frame is None:
        return "?", 0
    return frame.f_code.co_filename, frame.f_lineno


def subset_maps(dataset) -> tuple[list, object]:
    """The index lists of the Subsets around a data set, outermost first, and what they wrap."""
    from torch.utils.data import Subset

    maps = []
    while isinstance(dataset, Subset):
        maps.append(dataset.indices)
        dataset = dataset.dataset
    return maps, dataset


def _install() -> None:
    import torch
    import torch.distributed as dist
    import torch.utils.data as data
    from torch.nn.parallel import DistributedDataParallel

    models: list = []
    forwards = [0]
    ended = [False]
    loaders = [0]
    last_pass = [None]
    save = torch.serialization.save  # not torch.save, which a test probe may record

    original_init_pg = dist.init_process_group

    def init_process_group(*args, **kwargs):
        result = original_init_pg(*args, **kwargs)
        record("init", world_size=dist.get_world_size(), backend=str(dist.get_backend()))
        return result

    dist.init_process_group = init_process_group

    original_ddp_init = DistributedDataParallel.__init__

    def ddp_init(self, module, *args, **kwargs):
        original_ddp_init(self, module, *args, **kwargs)
        self._check_index = len(models)
        models.append(weakref.ref(self))
        record("wrap", model=self._check_index, module=type(module).__name__)

    DistributedDataParallel.__init__ = ddp_init

    original_forward = DistributedDataParallel.forward

    def forward(self, *inputs, **kwargs):
        tensors = tensors_in(inputs) + tensors_in(kwargs)
        training = self.module.training and torch.is_grad_enabled()
        forwards[0] += training
        try:
            hashes = {
                "digest": digest(*(tensor_digest(t).encode() for t in tensors)),
                "rows": row_digests(tensors),
            }
        except (RuntimeError, TypeError) as error:
            # a tensor without plain bytes (sparse, quantized, ...): counted, not compared
            hashes = {"digest": None, "rows": [], "unhashable": str(error)[:200]}
        record(
            "forward",
            model=getattr(self, "_check_index", None),
            training=training,
            shapes=[list(t.shape) for t in tensors],
            **hashes,
            **{"pass": last_pass[0]},
        )
        return original_forward(self, *inputs, **kwargs)

    DistributedDataParallel.forward = forward

    def recording(name: str, original):
        def collective(*args, **kwargs):
            file, line = caller()
            record("collective", name=name, file=file, line=line, forwards=forwards[0])
            return original(*args, **kwargs)

        return collective

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, recording(name, getattr(dist, name)))

    def end() -> None:
        """The wrapped modules' parameters and buffers, once per process."""
        if ended[0]:
            return
        ended[0] = True
        for ref in models:
            model = ref()
            if model is None:
                continue
            params = list(model.module.named_parameters())
            buffers = list(model.module.named_buffers())
            path = os.path.join(CHECK_DIR, f"{os.getpid()}.model{model._check_index}.pt")
            save({name: p.detach().cpu() for name, p in params}, path)
            record(
                "end",
                model=model._check_index,
                params=[[name, tensor_digest(p)] for name, p in params],
                buffers=[[name, tensor_digest(b)] for name, b in buffers],
                saved=path,
            )

    original_destroy = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        if dist.is_initialized():
            end()
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group

    def at_exit() -> None:
        if models:
            end()
        if _out["pid"] == os.getpid():
            record("exit")

    atexit.register(at_exit)

    original_loader_init = data.DataLoader.__init__

    def loader_init(self, *args, **kwargs):
        original_loader_init(self, *args, **kwargs)
        # map-style data sets only: an IterableDataset's sampler yields no indices
        if self.batch_sampler is not None and not isinstance(self.dataset, data.IterableDataset):
            maps, base = subset_maps(self.dataset)
            self.batch_sampler._check = {
                "loader": loaders[0],
                "sampler": type(self.sampler).__name__,
                "dataset": type(base).__name__,
                "maps": maps,
                "pass": 0,
            }
        loaders[0] += 1

    data.DataLoader.__init__ = loader_init

    original_batch_iter = data.BatchSampler.__iter__

    def batch_iter(self):
        tag = getattr(self, "_check", None)
        if tag is None:
            yield from original_batch_iter(self)
            return
        pass_number, tag["pass"] = tag["pass"], tag["pass"] + 1
        for batch in original_batch_iter(self):
            try:
                samples = []
                for index in batch:
                    for indices in tag["maps"]:
                        index = indices[index]
                    samples.append(int(index))
            except (TypeError, ValueError, IndexError):
                # indices of a kind this recorder does not know: the batch goes unrecorded
                samples = None
            last_pass[0] = [tag["loader"], pass_number]
            if samples is not None:
                record(
                    "batch",
                    loader=tag["loader"],
                    sampler=tag["sampler"],
                    dataset=tag["dataset"],
                    samples=samples,
                    **{"pass": pass_number},
                )
            yield batch

    data.BatchSampler.__iter__ = batch_iter


class AfterTorch(importlib.abc.MetaPathFinder):
    """Finds `torch` as Python would, and installs the hooks right after torch's own import."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        import_torch = spec.loader.exec_module

        def exec_module(module) -> None:
            import_torch(module)
            _install()

        spec.loader.exec_module = exec_module
        return spec


def load_next_sitecustomize() -> None:
    """Python loads one sitecustomize: load the one this file hides, if any."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.origin != __file__:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if CHECK_DIR:
    sys.meta_path.insert(0, AfterTorch())
load_next_sitecustomize()
