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
- collective  {name, file, line, forwards, args, window}   the script calls a
              torch.distributed collective (recorded before the call: a call that never returns
              is recorded too); file:line is the first caller outside torch; forwards =
              training forwards so far; args = what every rank must pass alike, for ARGUED
              collectives (the tensor's dtype and shape, op, src, dst), else None; window: a
              backward ran since the last optimizer step (where gradients are averaged by hand)
- end         {model, params, buffers, saved, saved_buffers, when}   at destroy_process_group,
              else at exit, else when the script lets the module go (a model local to a main()
              that returns without destroy_process_group; when: "end" or "collected"): a hash
              of each parameter and buffer of each wrapped module; the parameters themselves go
              to the file `saved`, the buffers to `saved_buffers` (None without buffers). The
              module is held by a weak reference: nothing is kept alive that the script let go.
- dropped     {model}                             instead of end: the module went unrecorded
- state       {key, module, site, params, buffers, saved, saved_buffers, when}   as end, for
              each module that DDP does not wrap and no other module holds (a frozen loss
              network, a teacher, an EMA copy, a model trained without DDP) and that holds
              parameters or buffers (those of a wrapped module left out); key: its class and
              site, the script's line that built it (with " #n" when several alive at the end
              share them); when: "end", or "collected" when the script let it go first
- step        {optimizer, kind, graded, outside, trains, first, collectives, grads, pass}
              after each optimizer step: optimizers numbered as they first step; graded: its
              parameters with a gradient; outside: how many of those no DDP-wrapped module
              holds; trains: the key (as state's) of the module that holds the first of those,
              first: its name there; collectives: collectives called since the first backward
              after the previous step; grads: a hash of those parameters' gradients
- save        {path, host, module_keys, first_key, wrapper}   each torch.save to a file: the
              keys that start with "module." in the state dicts it holds, and whether it
              pickled a DistributedDataParallel itself
- dataset_draws {dataset, generators}   a map-style data set's fetch of samples changed the
              state of python's random, numpy's global generator or torch's ("random", "numpy",
              "torch"): once per new generator; recorded in loader worker processes too
- exit        {}                                  Python shuts down normally

Another sitecustomize further along the path (a site's own, or the course's test probe) is
loaded after this one, so both work.
"""

import atexit
import collections
import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import socket
import sys
import sysconfig
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
# Collectives that do not combine values: no gradient is averaged in them.
UNREDUCING = ("barrier", "monitored_barrier")
# The folders of Python's own modules and of installed packages: a module is "built at" the
# first line of the call stack outside them, the script's.
LIBRARIES = tuple(
    os.path.join(path, "")
    for key, folder in sysconfig.get_paths().items()
    if key in ("stdlib", "platstdlib", "purelib", "platlib")
    for path in {folder, os.path.realpath(folder)}
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


def quietly(function):
    """The recorder's own work, which must never break the script: an error in it leaves its
    record out, and the script goes on."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with contextlib.suppress(Exception):
            return function(*args, **kwargs)
        return None

    return run


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


def built_at(module) -> str | None:
    """Where the script built `module` (or copied it: copy.deepcopy): its lines on the call
    stack outside the libraries and the recorders, past the module's own __init__, at most 3,
    outermost first, the module-level line only when nothing else: 'train.py:204 > 110' (line
    204 calls the function whose line 110 built it)."""
    found: list[tuple[str, int]] = []
    frame = sys._getframe(1)
    while frame is not None and len(found) < 3:
        code = frame.f_code
        name = code.co_filename
        if not (
            name.startswith(LIBRARIES)
            or name.startswith("<")
            or os.path.basename(name) == "sitecustomize.py"
            or (
                code.co_name in ("__init__", "__setstate__")
                and frame.f_locals.get("self") is module
            )
        ):
            if code.co_name == "<module>" and found:
                break
            found.append((os.path.basename(name), frame.f_lineno))
        frame = frame.f_back
    parts, previous = [], None
    for file, line in reversed(found):
        parts.append(str(line) if file == previous else f"{file}:{line}")
        previous = file
    return " > ".join(parts) or None


def rng_states() -> dict[str, int]:
    """A hash of each global random state a data set may draw from: python's random, numpy's
    (once the script imported numpy) and torch's CPU generator."""
    import random

    import torch

    states = {
        "random": hash(random.getstate()),
        "torch": hash(torch.get_rng_state().numpy().tobytes()),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        _, key, position, has_gauss, gauss = numpy.random.get_state()
        states["numpy"] = hash((key.tobytes(), position, has_gauss, gauss))
    return states


def module_keys(value, depth: int = 0) -> tuple[int, str | None]:
    """How many keys that start with "module." name a tensor in the dicts inside `value` (a
    state dict, a checkpoint of several), and the first of them."""
    import torch

    if depth > 4:
        return 0, None
    if isinstance(value, dict):
        items = list(value.items())[:100_000]
    elif isinstance(value, (list, tuple)):
        items = [(None, item) for item in value[:1_000]]
    else:
        return 0, None
    count, first = 0, None
    for key, item in items:
        if isinstance(item, torch.Tensor):
            if isinstance(key, str) and key.startswith("module."):
                count += 1
                first = first or key
        elif isinstance(item, (dict, list, tuple)):
            more, found = module_keys(item, depth + 1)
            count += more
            first = first or found
    return count, first


def sharded(tensor) -> bool:
    """A parameter that FSDP manages (a DTensor, FSDP1's FlatParameter): its gradients are
    reduced by FSDP, not by DDP."""
    return any(kind.__name__ in ("DTensor", "FlatParameter") for kind in type(tensor).__mro__)


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
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils.data import dataloader
    from torch.utils.data._utils import fetch as fetching

    # (number, weak reference to the wrapped module): the module, not the wrapper, so that a
    # script that keeps the module alone (model = model.module) is still recorded at the end,
    # and nothing is kept alive that the script let go
    models: list = []
    # id(wrapped module) -> its number, while it is alive
    wrapped_ids: dict[int, int] = {}
    # the models whose end is recorded (when the script let one go before the end)
    recorded: set[int] = set()
    # id(module) -> (weak reference, number, class, site) of each module alive in this process,
    # wrapped or not, in the order they were built
    modules: dict[int, tuple] = {}
    built = [0]
    # ids of the modules inside one recorded when the script let it go: recorded with it
    covered: set[int] = set()
    # key -> the hashes last recorded under it; key -> the number of its file
    states: dict[str, tuple] = {}
    state_files: dict[str, int] = {}
    forwards = [0]
    ended = [False]
    # the process that joined the process group: the one whose modules are recorded
    joined = [None]
    loaders = [0]
    last_pass = [None]
    # since the last optimizer step: whether a backward ran, and the collectives after it
    window = {"backward": False, "collectives": 0}
    # optimizer -> its number, in the order they first stepped; those whose outside
    # parameter was named
    optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    optimizer_count = [0]
    # optimizer -> (the key of the module it trains outside DDP, its first such parameter)
    owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    # data set class -> the generators its fetches drew from
    drawn: dict[str, set] = {}
    save = torch.serialization.save  # not torch.save, which the recorder records

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
        joined[0] = os.getpid()
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
        wrapped_ids[id(self.module)] = self._check_index
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
            inside = window["backward"] and name not in UNREDUCING
            window["collectives"] += inside
            record(
                "collective",
                name=name,
                file=file,
                line=line,
                forwards=forwards[0],
                args=agreed,
                window=inside,
            )
            return original(*args, **kwargs)

        return collective

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, recording(name, getattr(dist, name)))

    original_backward = torch.autograd.backward

    @functools.wraps(original_backward)
    def backward(*args, **kwargs):
        # Tensor.backward() calls torch.autograd.backward(): a backward of any model
        window["backward"] = True
        return original_backward(*args, **kwargs)

    torch.autograd.backward = backward

    def owner_of(tensor) -> tuple[str | None, str]:
        """The module alive that gives the parameter its longest name (the outermost that
        holds it): its key, as the state records name it, and the parameter's name in it."""
        owner: tuple[str | None, str] = (None, "a parameter of no module")
        for ref, _, kind, site in list(modules.values()):
            module = ref()
            for name, p in module.named_parameters() if module is not None else []:
                if p is tensor and (owner[0] is None or len(name) > len(owner[1])):
                    owner = (state_key(kind, site), name)
        return owner

    @quietly
    def gradients_digest(params: list) -> str:
        """A hash of the parameters' gradients (the first 100,000 values of each)."""
        return digest(*(as_bytes(p.grad.detach().reshape(-1)[:100_000]) for p in params))

    # optimizer steps under way: one optimizer's step may call another's (ZeRO's inner one)
    stepping = [0]

    def before_step(optimizer, args, kwargs) -> None:
        stepping[0] += 1

    @quietly
    def after_step(optimizer, args, kwargs) -> None:
        """Each optimizer step: how many of the parameters it stepped with a gradient no
        DDP-wrapped module holds, and the collectives since the backward before it (the
        window closes after the outermost step)."""
        stepping[0] = max(stepping[0] - 1, 0)
        if joined[0] != os.getpid():
            return
        number = optimizers.get(optimizer)
        if number is None:
            number = optimizers[optimizer] = optimizer_count[0]
            optimizer_count[0] += 1
        inside = wrapped_tensors()
        graded = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        outside = [p for p in graded if id(p) not in inside and not sharded(p)]
        trains, first = None, None
        if outside:
            if optimizer not in owners:
                owners[optimizer] = owner_of(outside[0])
            trains, first = owners[optimizer]
        record(
            "step",
            optimizer=number,
            kind=type(optimizer).__name__,
            graded=len(graded),
            outside=len(outside),
            trains=trains,
            first=first,
            collectives=window["collectives"],
            grads=gradients_digest(outside) if outside else None,
            **{"pass": last_pass[0]},
        )
        if not stepping[0]:
            window.update(backward=False, collectives=0)

    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)

    original_save = torch.save

    @quietly
    def record_save(obj, f) -> None:
        name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        if isinstance(name, str):
            # a file, not a buffer in memory
            count, first = module_keys(obj)
            record(
                "save",
                path=os.path.abspath(name),
                host=socket.gethostname(),
                module_keys=count,
                first_key=first,
                wrapper=isinstance(obj, DistributedDataParallel),
            )

    @functools.wraps(original_save)
    def save_recorded(obj, f, *args, **kwargs):
        result = original_save(obj, f, *args, **kwargs)
        record_save(obj, f)
        return result

    torch.save = save_recorded

    original_fetch = fetching._MapDatasetFetcher.fetch

    @functools.wraps(original_fetch)
    def fetch(self, possibly_batched_index):
        """A map-style data set's samples fetched (in the rank, or in a loader worker): which
        global random states __getitem__ (or the collate function) moved."""
        kind = type(subset_maps(self.dataset)[1]).__name__
        seen = drawn.setdefault(kind, set())
        if len(seen) == 3:
            return original_fetch(self, possibly_batched_index)
        before = quietly(rng_states)()
        batch = original_fetch(self, possibly_batched_index)
        after = quietly(rng_states)()
        if before is not None and after is not None:
            moved = {name for name, state in after.items() if before.get(name) != state}
            if moved - seen:
                seen |= moved
                quietly(record)("dataset_draws", dataset=kind, generators=sorted(seen))
        return batch

    fetching._MapDatasetFetcher.fetch = fetch

    def tensors_of(module, skip: set[int]) -> tuple[list, list]:
        """The module's named parameters and buffers, those whose id is in `skip` left out, and
        tensor subclasses (FSDP's DTensor shards, which differ between ranks by design)."""
        plain = (torch.Tensor, torch.nn.Parameter)
        params = [
            (n, p) for n, p in module.named_parameters() if id(p) not in skip and type(p) in plain
        ]
        buffers = [
            (n, b) for n, b in module.named_buffers() if id(b) not in skip and type(b) in plain
        ]
        return params, buffers

    def write(stem: str, params: list, buffers: list) -> tuple[str, str | None]:
        """The tensors saved to files beside the records: the parameters' path, the buffers'."""
        path = os.path.join(CHECK_DIR, f"{os.getpid()}.{stem}.pt")
        save({name: p.detach().cpu() for name, p in params}, path)
        buffers_path = None
        if buffers:
            buffers_path = os.path.join(CHECK_DIR, f"{os.getpid()}.{stem}.buffers.pt")
            save({name: b.detach().cpu() for name, b in buffers}, buffers_path)
        return path, buffers_path

    @quietly
    def end_model(index: int, module, when: str) -> None:
        """A wrapped module's parameters and buffers."""
        recorded.add(index)
        params, buffers = tensors_of(module, set())
        path, buffers_path = write(f"model{index}", params, buffers)
        record(
            "end",
            model=index,
            params=[[name, tensor_digest(p)] for name, p in params],
            buffers=[[name, tensor_digest(b)] for name, b in buffers],
            saved=path,
            saved_buffers=buffers_path,
            when=when,
        )

    def wrapped_tensors() -> set[int]:
        """The ids of the wrapped modules' parameters and buffers."""
        found: set[int] = set()
        for _, ref in models:
            module = ref()
            if module is not None:
                found.update(map(id, module.parameters()))
                found.update(map(id, module.buffers()))
        return found

    @quietly
    def record_state(module, key: str, kind: str, site: str | None, when: str) -> None:
        """A module that DDP does not wrap: its parameters and buffers (a wrapped module's
        left out), unless it has none or the same as last recorded under its key."""
        if any(map(sharded, [*module.parameters(), *module.buffers()])):
            # FSDP's: each rank holds its own shard, by design
            return
        params, buffers = tensors_of(module, wrapped_tensors())
        if not params and not buffers:
            return
        hashes = (
            [[name, tensor_digest(p)] for name, p in params],
            [[name, tensor_digest(b)] for name, b in buffers],
        )
        if states.get(key) == hashes:
            return
        states[key] = hashes
        number = state_files.setdefault(key, len(state_files))
        path, buffers_path = write(f"state{number}", params, buffers)
        record(
            "state",
            key=key,
            module=kind,
            site=site,
            params=hashes[0],
            buffers=hashes[1],
            saved=path,
            saved_buffers=buffers_path,
            when=when,
        )

    def state_key(kind: str, site: str | None) -> str:
        return f"{kind}, built at {site}" if site else kind

    def track(module) -> None:
        kind = type(module).__name__
        modules[id(module)] = (weakref.ref(module), built[0], kind, built_at(module))
        built[0] += 1

    original_module_init = torch.nn.Module.__init__
    original_setstate = torch.nn.Module.__setstate__

    @functools.wraps(original_module_init)
    def module_init(self, *args, **kwargs):
        original_module_init(self, *args, **kwargs)
        track(self)

    @functools.wraps(original_setstate)
    def module_setstate(self, state):
        # copy.deepcopy (an EMA copy) and torch.load of a whole module build it this way
        original_setstate(self, state)
        track(self)

    def module_del(self):
        """The script lets a module go before the end: a wrapped one, or one that no other
        module holds, is recorded now, while it is whole."""
        # Python shutting down, a module half built: no record, and no error either
        with contextlib.suppress(Exception):
            entry = modules.pop(id(self), None)
            index = wrapped_ids.pop(id(self), None)
            inside = id(self) in covered
            covered.discard(id(self))
            if entry is None or ended[0] or joined[0] != os.getpid():
                return
            if index is not None:
                if index not in recorded:
                    end_model(index, self, "collected")
            elif not inside and not isinstance(self, DistributedDataParallel):
                _, _, kind, site = entry
                record_state(self, state_key(kind, site), kind, site, "collected")
            else:
                return
            # the modules inside it go next: recorded with it
            covered.update(id(m) for m in self.modules() if m is not self)

    torch.nn.Module.__init__ = module_init
    torch.nn.Module.__setstate__ = module_setstate
    torch.nn.Module.__del__ = module_del

    @quietly
    def end() -> None:
        """The wrapped modules' parameters and buffers, and those of every module alive that
        no other holds, once per process."""
        if ended[0]:
            return
        ended[0] = True
        for index, ref in models:
            if index in recorded:
                continue
            module = ref()
            if module is None:
                record("dropped", model=index)
                continue
            end_model(index, module, "end")
        alive = []
        for ref, number, kind, site in list(modules.values()):
            module = ref()
            if module is not None:
                alive.append((number, module, kind, site))
        held = {id(child) for _, module, _, _ in alive for child in module.children()}
        roots = [
            (module, kind, site)
            for _, module, kind, site in sorted(alive, key=lambda entry: entry[0])
            if id(module) not in held
            and id(module) not in wrapped_ids
            and not isinstance(module, DistributedDataParallel)
        ]
        keys = collections.Counter(state_key(kind, site) for _, kind, site in roots)
        seen: collections.Counter = collections.Counter()
        for module, kind, site in roots:
            key = state_key(kind, site)
            if keys[key] > 1:
                key, seen[key] = f"{key} #{seen[key]}", seen[key] + 1
            record_state(module, key, kind, site, "end")

    original_destroy = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        if dist.is_initialized():
            end()
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group

    def at_exit() -> None:
        if models or joined[0] == os.getpid():
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
