"""The course's steps, listed once: each script, the script its diff is read against, how its
quick run launches it, what it teaches, the APIs its diff must show, its size budgets and what
its quick run shows. The diff contract, the spine and failure tests, the benchmark test and the
README check read this.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# Most changed code lines a step's diff may have, whatever its own budget says: one idea a step.
# Step 1 starts processes and a group bound to its GPU at once; step 6 drops mp.spawn's start-up
# (its port, its GPU check) for the launcher's variables; step 8 resumes mid-epoch (the loader's
# place, a snapshot every N steps, the steps left).
CEILING, CEILINGS = 30, {"1": 40, "6": 35, "8": 40}
# Lines per script: the spine, then the steps that build on part 4. At 79 columns
# (MAX_WIDTH), so that no line wraps on a terminal, a projector or in `diff -y` of two steps.
# LESSON_LINES: what steps 2, 3, 5 and 6 add so that their quick runs print what they change
# (the weights' norm, the shards, the checkpoint's keys, the launcher's variables); every later
# script carries them, so each limit from step 2 on counts them on top of its own.
SPINE_LINES, AFTER_SPINE_LINES, LESSON_LINES = 240, 300, 12
MAX_WIDTH = 79


class Claim(Enum):
    """What a step's quick run shows, as the course says it; tests/test_course_spine.py has one
    check for each, run on the step's launch (a few launch a second run)."""

    EPOCH_LINES = "rank 0 prints one line per epoch, counting every image once"
    WHOLE_LINES = "lines of processes that share the terminal stay whole"
    SAME_AS_PART1 = "on a CPU it trains as part 1 does: the same seed, the same losses"
    SAYS_DEVICE = "each process says its device and threads, and its rank from step 1 on"
    DP_GPUS = "DataParallel says how many GPUs it uses, none on a CPU"
    BARE_LOAD = "the checkpoint loads into a bare model"
    ONE_GROUP = "each process joins one gloo group with the rank it was given"
    THREAD_SHARE = "each rank takes its share of the cores"
    WHOLE_DATA_EACH = "without a sampler every rank trains on the whole data set"
    ONE_WRITER = "rank 0 alone saves the checkpoint"
    IN_SYNC = "the ranks' weights are equal after training"
    PREFIXED = "the wrapped model's checkpoint keys carry 'module.'"
    SHARDS = "the ranks' shards cover the data once per epoch, reshuffled every epoch"
    OWN_CROPS = "each rank draws its own crops and flips, from equal initial weights"
    NO_PREFIX = "the checkpoint has no 'module.' and holds the trained weights"
    RELEASED = "every process releases its group before it exits"
    OMP_KEPT = "under torchrun each worker keeps OMP_NUM_THREADS=1"
    ALONE = "under plain python the script is a world of one"
    # The lesson lines (LESSON_LINES): each step's quick run prints what it changed.
    SAME_NORM = "each rank prints its trained weights' norm: the same number on every rank"
    SHARD_LINE = "each rank prints the size of its shard, and that no other rank has its images"
    KEYS_LINE = "the checkpoint's first keys print, without 'module.'"
    LAUNCHER_LINE = "each worker prints the variables its launcher set, torchrun's over Slurm's"


@dataclass(frozen=True)
class Step:
    label: str  # its row in the README's course map: "Part 1", "1", ..., "speed", "7"
    script: str
    before: str | None  # the script its diff is read against (None: the base)
    tag: str | None  # its comment tag in the script: `# step 3`, `# speed`, ...
    launcher: str  # what its quick run starts it with: "python" or "torchrun"
    teaches: str  # what its diff teaches, as the README's course map says it
    # What the step is about: each must appear in its added lines, and every added hunk
    # (imports apart) must show one of them or the tag, so an off-topic change fails.
    apis: tuple[str, ...] = ()
    # Most changed code lines (added + removed, the module docstring apart): the measured size
    # of each diff, a ceiling to lower, raised only for a change the step itself needs.
    budget: int = 0
    max_lines: int = AFTER_SPINE_LINES + LESSON_LINES
    spine: bool = False  # on the way from part 1 to part 4: the tightest budgets
    checks_gpus: bool = False  # refuses more processes per node than GPUs (step 4 on)
    claims: tuple[Claim, ...] = ()

    @property
    def pair(self) -> tuple[str, str]:
        """The two scripts of its diff: the one before, then this one."""
        assert self.before, f"{self.script} is a base: no diff"
        return self.before, self.script


PART1 = "part1_single/train.py"
STEP1 = "part3_ddp/step1_process_group.py"
STEP2 = "part3_ddp/step2_ddp_wrap.py"
STEP3 = "part3_ddp/step3_distributed_sampler.py"
STEP4 = "part3_ddp/step4_device_placement.py"
STEP5 = "part3_ddp/step5_checkpoint.py"
STEP6 = "part4_torchrun/train.py"
SPEED = "part4_torchrun/speed"  # the speed chapter: steps on step 6, one knob each
FAST1 = f"{SPEED}/speed1_precision.py"
FAST2 = f"{SPEED}/speed2_compile.py"
FAST3 = f"{SPEED}/speed3_workers.py"  # has every speed flag
FAST4 = f"{SPEED}/speed4_device_data.py"  # the training set on the device
FAULTS = "part4_torchrun/fault_tolerance"  # steps 7 to 11: snapshots and restarts
SNAP1 = f"{FAULTS}/step07_epoch_snapshot.py"
SNAP2 = f"{FAULTS}/step08_step_snapshot.py"  # resumes mid-epoch
SNAP3 = f"{FAULTS}/step09_exact_resume.py"  # resumes exactly, mid-epoch
SNAP4 = f"{FAULTS}/step10_checked_snapshot.py"  # resumes its own run's snapshot only
SNAP5 = f"{FAULTS}/step11_locked_snapshot.py"  # and one run at a time
SPINE = {"max_lines": SPINE_LINES + LESSON_LINES, "spine": True}
# What every quick run of the DDP steps shows, from step 1 on.
IN_A_GROUP = (
    *(Claim.ONE_GROUP, Claim.SAYS_DEVICE, Claim.ONE_WRITER, Claim.RELEASED),
    *(Claim.EPOCH_LINES, Claim.WHOLE_LINES),
)
SPAWNED = (*IN_A_GROUP, Claim.THREAD_SHARE)  # mp.spawn splits the cores among its processes

STEPS = [
    Step(
        "Part 1",
        PART1,
        None,
        None,
        "python",
        "the baseline on one device",
        **SPINE,
        claims=(Claim.EPOCH_LINES, Claim.WHOLE_LINES, Claim.SAYS_DEVICE, Claim.BARE_LOAD),
    ),
    Step(
        "Part 2",
        "part2_dp/train.py",
        PART1,
        "DP",
        "python",
        "`nn.DataParallel`: one process, all GPUs",
        ("DataParallel", "model.module"),
        7,
        claims=(
            *(Claim.DP_GPUS, Claim.SAME_AS_PART1, Claim.EPOCH_LINES, Claim.WHOLE_LINES),
            Claim.BARE_LOAD,
        ),
    ),
    Step(
        "1",
        STEP1,
        PART1,
        "step 1",
        "python",
        "one process per device, a process group",
        (
            *("init_process_group", "destroy_process_group", "mp.spawn", "set_device"),
            *("barrier", "gloo", "nccl", "MASTER_ADDR", "rank == 0", "device_id="),
        ),
        39,
        **SPINE,
        claims=(*SPAWNED, Claim.WHOLE_DATA_EACH, Claim.BARE_LOAD),
    ),
    Step(
        "2",
        STEP2,
        STEP1,
        "step 2",
        "python",
        "`DDP(model)`: gradients averaged",
        ("DDP(",),
        8,
        **SPINE,
        claims=(
            *(*SPAWNED, Claim.WHOLE_DATA_EACH, Claim.IN_SYNC, Claim.PREFIXED),
            Claim.SAME_NORM,
        ),
    ),
    Step(
        "3",
        STEP3,
        STEP2,
        "step 3",
        "python",
        "a shard per rank, `set_epoch`, global metrics",
        (
            *("DistributedSampler(", "set_epoch(", "all_reduce(", "Subset("),
            "manual_seed(",
        ),
        25,
        **SPINE,
        claims=(
            *(*SPAWNED, Claim.SHARDS, Claim.OWN_CROPS, Claim.IN_SYNC, Claim.PREFIXED),
            *(Claim.SAME_NORM, Claim.SHARD_LINE),
        ),
    ),
    Step(
        "4",
        STEP4,
        STEP3,
        "step 4",
        "python",
        "`cuda:LOCAL_RANK`",
        ('f"cuda:{local_rank}"', "device_count()", "local_world_size"),
        20,
        **SPINE,
        checks_gpus=True,
        claims=(
            *(*SPAWNED, Claim.SHARDS, Claim.OWN_CROPS, Claim.IN_SYNC, Claim.PREFIXED),
            *(Claim.SAME_NORM, Claim.SHARD_LINE),
        ),
    ),
    Step(
        "5",
        STEP5,
        STEP4,
        "step 5",
        "python",
        "save once, without `module.`",
        ("model.module", "load_state_dict"),
        7,
        **SPINE,
        checks_gpus=True,
        claims=(
            *(*SPAWNED, Claim.SHARDS, Claim.OWN_CROPS, Claim.IN_SYNC, Claim.NO_PREFIX),
            *(Claim.BARE_LOAD, Claim.SAME_NORM, Claim.SHARD_LINE, Claim.KEYS_LINE),
        ),
    ),
    Step(
        "6",
        STEP6,
        STEP5,
        "step 6",
        "torchrun",
        "the launcher says who each process is",
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
        33,
        **SPINE,
        checks_gpus=True,
        claims=(
            *(*IN_A_GROUP, Claim.OMP_KEPT, Claim.SHARDS, Claim.OWN_CROPS, Claim.IN_SYNC),
            *(Claim.NO_PREFIX, Claim.BARE_LOAD, Claim.ALONE, Claim.SAME_NORM),
            *(Claim.SHARD_LINE, Claim.KEYS_LINE, Claim.LAUNCHER_LINE),
        ),
    ),
    Step(
        "speed 1",
        FAST1,
        STEP6,
        "speed 1",
        "python",
        "mixed precision: bf16 or fp16 autocast, a GradScaler",
        ("autocast", "GradScaler", "--precision"),
        30,
        checks_gpus=True,
    ),
    Step(
        "speed 2",
        FAST2,
        FAST1,
        "speed 2",
        "python",
        "channels-last, `model.compile()`",
        ("channels_last", "compile()", "--channels-last", "--compile"),
        16,
        checks_gpus=True,
    ),
    Step(
        "speed 3",
        FAST3,
        FAST2,
        "speed 3",
        "python",
        "loader workers, pinned memory, `non_blocking`",
        ("num_workers", "pin_memory", "non_blocking", "--workers"),
        25,
        checks_gpus=True,
    ),
    Step(
        "speed 4",
        FAST4,
        FAST3,
        "speed 4",
        "python",
        "the data on the device: batches gathered, cropped and flipped there",
        ("--device-data", "device_batches(", "augment("),
        30,
        # speed 3's 289 lines and its own 30, and the lesson lines (speed 2's
        # and 3's one each besides)
        max_lines=320 + LESSON_LINES + 1,
        checks_gpus=True,
    ),
    Step(
        "7",
        SNAP1,
        STEP6,
        "step 7",
        "torchrun",
        "a snapshot every epoch; a restart resumes",
        ("os.replace(", "load_state_dict(", "range(start_epoch"),
        30,
        checks_gpus=True,
    ),
    Step(
        "8",
        SNAP2,
        SNAP1,
        "step 8",
        "torchrun",
        "resume mid-epoch: the loader's place, a snapshot every N steps",
        (
            *("StatefulDataLoader(", "--snapshot-every", "first_step", "verbose, save"),
            "steps done",
        ),
        40,
        checks_gpus=True,
    ),
    Step(
        "9",
        SNAP3,
        SNAP2,
        "step 9",
        "torchrun",
        "an exact resume: each rank's random state, the loader's own, DDP's buckets",
        ("all_gather_object(", "set_rng_state(", "generator=", "backward()"),
        17,
        checks_gpus=True,
    ),
    Step(
        "10",
        SNAP4,
        SNAP3,
        "step 10",
        "torchrun",
        "a snapshot that belongs to its run: recorded and checked",
        ("is another run's", "is not a snapshot", "dict, run", "state, run", "def stop("),
        30,
        # step 9's 295 lines and its own 20, and the lesson lines
        max_lines=320 + LESSON_LINES,
        checks_gpus=True,
    ),
    Step(
        "11",
        SNAP5,
        SNAP4,
        "step 11",
        "torchrun",
        "one run at a time: a lock, and a refusal that ends the job",
        ("fcntl.flock(", ".tmp", "signal.SIGTERM"),
        15,
        # the longest script: step 10's 315 lines and its own 15, and the lesson
        # lines
        max_lines=330 + LESSON_LINES,
        checks_gpus=True,
    ),
]
BY_LABEL = {s.label: s for s in STEPS}

# ---- a chapter after the course: part4_torchrun/beyond_ddp/ -------------------------------------
# Its steps follow the same diff contract as the course's (test_diff_contract.py reads both
# lists); they are not rows of the course map. Steps 1 to 4 build DDP by hand on a small MLP (step
# 1, the chapter's own base, is read whole); steps 5 to 7 take part 4's train.py to FSDP2.
BEYOND = "part4_torchrun/beyond_ddp"
BEYOND_README = f"{BEYOND}/README.md"
BY_HAND1 = f"{BEYOND}/step1_by_hand.py"
BY_HAND2 = f"{BEYOND}/step2_buckets.py"
BY_HAND3 = f"{BEYOND}/step3_hooks.py"
ZERO1 = f"{BEYOND}/step4_zero1.py"
FSDP2 = f"{BEYOND}/step5_fsdp2.py"
FSDP2_MEMORY = f"{BEYOND}/step6_memory.py"
FSDP2_DCP = f"{BEYOND}/step7_dcp.py"
CHAPTER = {"launcher": "torchrun", "max_lines": AFTER_SPINE_LINES}

BEYOND_STEPS = [
    Step("beyond 1", BY_HAND1, None, "by hand 1", teaches="DDP by hand, naive", **CHAPTER),
    Step(
        "beyond 2",
        BY_HAND2,
        BY_HAND1,
        "by hand 2",
        teaches="buckets, all-reduced after backward()",
        apis=(".buckets", "torch.cat(", "dist.all_reduce(flat)", "--bucket-mb", "bucket_mb"),
        budget=30,
        **CHAPTER,
    ),
    Step(
        "beyond 3",
        BY_HAND3,
        BY_HAND2,
        "by hand 3",
        teaches="sent from gradient hooks, asynchronously, waited for before the step",
        apis=(
            *("register_post_accumulate_grad_hook", "async_op=True", "work.wait()"),
            *("self.sent", "self.ready"),
        ),
        budget=29,
        **CHAPTER,
    ),
    Step(
        "beyond 4",
        ZERO1,
        BY_HAND3,
        "by hand 4",
        teaches="ZeRO-1: optimizer state sharded",
        apis=("ZeRO1(", "optimizer_class(mine", "dist.broadcast(param.detach(), src=owner)"),
        budget=26,
        **CHAPTER,
    ),
    Step(
        "beyond 5",
        FSDP2,
        STEP6,
        "FSDP2",
        teaches="`fully_shard` in DDP's place; the whole weights gathered to save",
        apis=("fully_shard(", "init_device_mesh(", "get_model_state_dict("),
        budget=30,
        **CHAPTER,
    ),
    Step(
        "beyond 6",
        FSDP2_MEMORY,
        FSDP2,
        "FSDP2",
        teaches="what each rank holds: its shards",
        apis=("to_local()",),
        budget=7,
        **CHAPTER,
    ),
    Step(
        "beyond 7",
        FSDP2_DCP,
        FSDP2_MEMORY,
        "FSDP2",
        teaches="sharded checkpoints (DCP), resumed on any number of ranks",
        apis=("dcp.save(", "dcp.load(", "--sharded", "--resume", "scheduler.last_epoch"),
        budget=30,
        **CHAPTER,
    ),
    Step(
        "beyond 8",
        f"{BEYOND}/step8_drop_in.py",
        SNAP1,
        "drop-in",
        teaches="steps 3 and 4 as drop-ins (by_hand.py) in part 4's training, one flag each",
        apis=("ByHandDDP(", "ZeRO1(", "consolidate_state_dict(", "--by-hand-ddp", "--zero1"),
        budget=21,
        **CHAPTER,
    ),
]
