"""The exercise autograder: trains a learner's DDP script as a learner launches it (srun-style or
torchrun, at a world size), reads what each process did from the probe (tests/probe/) and from
the course's checker for any script (part4_torchrun/your_script/checker/: its verdicts "replicas
equal" and "loader samples disjoint" are the grader's), and checks what DDP must compute and
what the training must compute (its figures, its batches, its steps, its optimizer), claim by
claim, in step order. Each claim holds (with the evidence that shows it), fails (with the
cause the evidence points to, and what to do), or is not checked (nothing showed it: the job
ended first).

- run.py: the launch, and what a training run left behind (output, records, files)
- causes.py: why a job did not end well (a crash, a race, a hung worker, a skipped collective)
- checks.py: one check per claim; claims.py: the claims, in step order, and the grading
- report.py: the report and its log

test_exercises.py grades with it; grade_mutants.py grades one-mistake versions of a solution.
"""
