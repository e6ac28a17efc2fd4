"""The recording half of ddp_check.py: what each process of a DDP run did, for any script.

Python imports a module named `sitecustomize` at start-up, from the first folder on its path that
has one. `ddp_check.py` puts this folder first on PYTHONPATH and names a folder in DDP_CHECK_DIR,
so every process of the run (each torchrun worker, each srun task) loads it, and the script runs
unchanged. The hooks go in right after the process imports torch. Each process appends JSON lines
to DDP_CHECK_DIR/<pid>.jsonl, one per event; every line has "event", "rank" (the process group's,
else the launcher's RANK, else None) and "time":

- init        {world_size, backend, timeout, timeout_by, deadline, draws}   after
              init_process_group; timeout: the group's in seconds (None: PyTorch's default),
              timeout_by: "script", "deadline" (DDP_CHECK_DEADLINE gave it) or None
- wrap        {model, module}                     a DistributedDataParallel is made; `model`
                                                  numbers them in this process
- forward     {model, training, shapes, digest, rows, pass}   each call of a DDP-wrapped
              module: training = the module is in train mode and gradients are on; digest = a
              hash of all its tensor arguments; rows = a hash of each row (dim 0) of the first
              tensor argument with 2 or more dimensions, else of the whole first tensor (at most
              MAX_ROWS per call); pass = [loader, pass] of the last batch a loader handed out in
              this process (None without one): which epoch the input belongs to
- draws       {model, before, after}              with DDP_CHECK_DRAWS=1, after each training
              forward: a hash of torch's random states (the CPU generator's, each CUDA
              device's once CUDA is in use) before and after it; they differ when it drew
- pass        {loader, pass, sampler}             a pass of a loader with a DistributedSampler
              starts: its seed, shuffle, num_replicas, rank, epoch and drop_last
- batch       {loader, sampler, dataset, pass, samples, rows}   each batch a map-style
              DataLoader hands out, as indices into the underlying data set (through Subsets),
              recorded as the loader returns it; rows: a hash of each row, as forward's (None
              when the loader may reorder batches: in_order=False)
- collective  {name, file, line, forwards, args}  the script calls a torch.distributed
              collective (recorded before the call: a call that never returns is recorded too);
              file:line is the first caller outside torch; forwards = training forwards so far;
              args = what every rank must pass alike, for ARGUED collectives (the tensor's
              dtype and shape, op, src, dst), else None
- end         {model, params, buffers, saved, saved_buffers}   at destroy_process_group, else
              at exit: a hash of each parameter and buffer of each wrapped module; the
              parameters themselves go to the file `saved`, the buffers to `saved_buffers`
              (None without buffers). The module is held by a weak reference: a script that
              drops the wrapper (model = model.module) is still recorded.
- dropped     {model}                             instead of end: the module was collected
- exit        {}                                  Python shuts down normally

Another sitecustomize further along the path (a site's own, or the course's test probe) is
loaded after this one, so both work.
"""

import atexit
import collections
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import time
import weakref

CHECK_DIR = os.environ.get("DDP_CHECK_DIR")
# seconds: init_process_group's timeout when the script gives none (ddp_check.py --deadline)
DEADLINE = os.environ.get("DDP_CHECK_DEADLINE")
# "1": record the random states around each training forward (ddp_check.py --draws)
DRAWS = os.environ.get("DDP_CHECK_DRAWS") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))
MAX_ROWS = 1024
COLLECTIVES = (
    *("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all"),
    *("all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list"),
    *("gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter"),
    "scatter_object_list",
)
# Collectives whose arguments must agree on every rank: their tensor's dtype and shape, and
# these, are recorded. Others (gather's lists, all_to_all's splits) may differ by design.
ARGUED = ("all_reduce", "reduce", "broadcast", "broadcast_object_list")
AGREED = ("op", "src", "dst", "group_src", "group_dst")
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
    """A hash of each row of the first tensor with 2 or more dimensions: its dtype and bytes,
    not its shape, so that a batch flattened on its way to forward keeps its rows' hashes."""
    first = next((t for t in tensors if t.dim() >= 2), None)
    if first is None:
        return [tensor_digest(tensors[0])] if tensors else []
    rows = as_bytes(first[:MAX_ROWS])
    kind = str(first.dtype).encode()
    return [digest(kind, row.tobytes()) for row in rows]


def rng_digest() -> str:
    """A hash of the random states a forward may draw from: torch's CPU generator, and each
    CUDA device's once CUDA is in use (asking earlier would start it)."""
    import torch

    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return digest(*(state.numpy().tobytes() for state in states))


def collective_args(signature, args, kwargs) -> str | None:
    """What every rank must pass alike to an ARGUED collective, as text: 'float32[4], op=SUM'."""
    import torch

    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    parts = []
    tensor = bound.arguments.get("tensor")
    if isinstance(tensor, torch.Tensor):
        parts.append(f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}")
    for name in AGREED:
        value = bound.arguments.get(name)
        if value is not None:
            parts.append(f"{name}={getattr(value, 'name', value)}")
    return ", ".join(parts)


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
    import datetime

    import torch
    import torch.distributed as dist
    import torch.utils.data as data
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import dataloader

    # (number, weak reference to the wrapped module): the module, not the wrapper, so that a
    # script that keeps the module alone (model = model.module) is still recorded at the end,
    # and nothing is kept alive that the script let go
    models: list = []
    forwards = [0]
    ended = [False]
    loaders = [0]
    last_pass = [None]
    save = torch.serialization.save  # not torch.save, which a test probe may record

    original_init_pg = dist.init_process_group
    init_signature = inspect.signature(original_init_pg)

    def init_process_group(*args, **kwargs):
        try:
            bound = init_signature.bind(*args, **kwargs)
        except TypeError:
            bound = None  # the call fails as it would without the recorder
        timeout_by = None
        if bound is not None:
            if bound.arguments.get("timeout") is not None:
                # the script's own timeout stays
                timeout_by = "script"
            elif DEADLINE:
                bound.arguments["timeout"] = datetime.timedelta(seconds=float(DEADLINE))
                timeout_by = "deadline"
            args, kwargs = bound.args, bound.kwargs
        result = original_init_pg(*args, **kwargs)
        timeout = bound.arguments.get("timeout") if bound is not None else None
        record(
            "init",
            world_size=dist.get_world_size(),
            backend=str(dist.get_backend()),
            timeout=timeout.total_seconds() if timeout is not None else None,
            timeout_by=timeout_by,
            deadline=float(DEADLINE) if DEADLINE else None,
            draws=DRAWS,
        )
        return result

    dist.init_process_group = init_process_group

    original_ddp_init = DistributedDataParallel.__init__

    def ddp_init(self, module, *args, **kwargs):
        original_ddp_init(self, module, *args, **kwargs)
        self._check_index = len(models)
        models.append((self._check_index, weakref.ref(self.module)))
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
        index = getattr(self, "_check_index", None)
        record(
            "forward",
            model=index,
            training=training,
            shapes=[list(t.shape) for t in tensors],
            **hashes,
            **{"pass": last_pass[0]},
        )
        if not (DRAWS and training):
            return original_forward(self, *inputs, **kwargs)
        before = rng_digest()
        result = original_forward(self, *inputs, **kwargs)
        record("draws", model=index, before=before, after=rng_digest())
        return result

    DistributedDataParallel.forward = forward

    def recording(name: str, original):
        signature = inspect.signature(original) if name in ARGUED else None

        def collective(*args, **kwargs):
            file, line = caller()
            agreed = collective_args(signature, args, kwargs) if signature else None
            record("collective", name=name, file=file, line=line, forwards=forwards[0], args=agreed)
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
        for index, ref in models:
            module = ref()
            if module is None:
                record("dropped", model=index)
                continue
            params = list(module.named_parameters())
            buffers = list(module.named_buffers())
            path = os.path.join(CHECK_DIR, f"{os.getpid()}.model{index}.pt")
            save({name: p.detach().cpu() for name, p in params}, path)
            buffers_path = None
            if buffers:
                buffers_path = os.path.join(CHECK_DIR, f"{os.getpid()}.model{index}.buffers.pt")
                save({name: b.detach().cpu() for name, b in buffers}, buffers_path)
            record(
                "end",
                model=index,
                params=[[name, tensor_digest(p)] for name, p in params],
                buffers=[[name, tensor_digest(b)] for name, b in buffers],
                saved=path,
                saved_buffers=buffers_path,
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
                # batches drawn, not yet returned: (pass, samples), oldest first
                "drawn": collections.deque(),
                "in_order": getattr(self, "in_order", True),
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
        # a new pass: batches an earlier iterator drew ahead and never returned are dropped
        tag["drawn"].clear()
        sampler = self.sampler
        if isinstance(sampler, data.DistributedSampler):
            fields = ("seed", "shuffle", "num_replicas", "rank", "epoch", "drop_last")
            agreed = {name: getattr(sampler, name, None) for name in fields}
            record("pass", loader=tag["loader"], sampler=agreed, **{"pass": pass_number})
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
            tag["drawn"].append((pass_number, samples))
            yield batch

    data.BatchSampler.__iter__ = batch_iter

    def returning(original_next_data):
        # The batch as the loader returns it, in the order its indices were drawn (workers
        # draw ahead, prefetching): its indices and its rows' hashes, paired.
        def next_data(self):
            if getattr(self, "_check_inside", False):
                # an iterator class's _next_data calling its base's: recorded once, outermost
                return original_next_data(self)
            self._check_inside = True
            try:
                batch = original_next_data(self)
            finally:
                self._check_inside = False
            tag = getattr(self._index_sampler, "_check", None)
            if tag is None or not tag["drawn"]:
                return batch
            pass_number, samples = tag["drawn"].popleft()
            last_pass[0] = [tag["loader"], pass_number]
            if samples is None:
                return batch
            rows = None
            if tag["in_order"]:
                try:
                    rows = row_digests(tensors_in(batch))
                except (RuntimeError, TypeError):
                    rows = None
            record(
                "batch",
                loader=tag["loader"],
                sampler=tag["sampler"],
                dataset=tag["dataset"],
                samples=samples,
                rows=rows,
                **{"pass": pass_number},
            )
            return batch

        return next_data

    original_iter_init = dataloader._BaseDataLoaderIter.__init__

    def iter_init(self, *args, **kwargs):
        # Each iterator class (single-process, worker processes, a library's own) gets its
        # _next_data wrapped once, at its first use; not __next__, which a test probe replaces
        # and puts back.
        kind = type(self)
        if "_check_next_data" not in vars(kind):
            kind._next_data = returning(kind._next_data)
            kind._check_next_data = True
        original_iter_init(self, *args, **kwargs)

    dataloader._BaseDataLoaderIter.__init__ = iter_init


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
