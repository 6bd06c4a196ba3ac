"""Fault tolerance without restarts (torchft, issue 30), on CPU over gloo: `--nproc 2
--fault_tolerance.enable true --fault_tolerance.group_size 2` runs two replica groups of one rank
and torchft's Lighthouse. A group whose rank is killed (debug.fault_at_step) restarts and
recovers live from the other, which never stops; a stop signal stops every group at one step,
and the whole job resumes from that checkpoint exactly; a group may be a pipeline (two groups of
two stages log the losses of the 2 x 2 job); with LocalSGD the groups train apart and end equal
after the last sync.

What the loss curves must equal, by torchft's semantics:
- per-step averaging: until the kill both groups log the same loss (the mean over both groups'
  batches); while the killed group is away the survivor trains alone, exactly as that group
  resumed alone from the checkpoint before the kill (same steps, same losses); from the recovery
  on both groups again log one loss, each group reading its own data where it left it.
- DiLoCo: each group logs its own loss (inner steps on its own data); the survivor's losses, from
  the checkpoint before the kill to the sync after the one where the other group comes back,
  equal the survivor resumed alone from that checkpoint: its syncs average its own weight deltas
  only, and at the recovery sync the other group holds a copy of the survivor's.
In both, the groups end with bit-identical weights (the logged sha256 of every rank's shards).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

from tessera.trainer.lighthouse import command as lighthouse_command


SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--metrics.disable_color_printing", "true"]
FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]
# the survivor must still be training when the killed group is back: under load a restart took
# 47+ of the survivor's steps (DiLoCo) and more than the 58 steps it had left (per step, ~0.12 s each);
# a multiple of the DiLoCo test's sync_steps (4), so that its last step syncs the groups. The per-step
# run is stopped (SIGTERM) once the killed group is back, ~100 steps of both groups sooner
STEPS = 148
ENV = {key: value for key, value in os.environ.items() if key != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
# a dead group is noticed after 1 s without a heartbeat (torchft's default is 5 s)
ENV.update(PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", TESSERA_LIGHTHOUSE_ARGS="--heartbeat_timeout_ms 1000")


def command(dump, *args):
    return [sys.executable, "-m", "tessera.trainer.main", *SMALL, "--job.dump_folder", str(dump), *args]


def run(dump, *args, env=ENV):
    """The run's output, stdout and stderr together."""
    result = subprocess.run(command(dump, *args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout


def logged(stdout, group=None):
    """[(step, 'loss X grad_norm Y')] in order, of one replica group (None: a run without groups)."""
    prefix = "" if group is None else rf"\[replica {group}\] "
    return [(int(step), values) for step, values in
            re.findall(rf"^{prefix}step +(\d+)/\d+ +(loss +\S+ +grad_norm +\S+)", stdout, re.M)]


def digests(stdout):
    return dict(re.findall(r"^\[replica \d\] fault tolerance: replica group (\d) ends at step \d+, weights sha256 (\w+)$",
                           stdout, re.M))


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def alone(faulty_dump, tmp_path, load_step, last_step, *args):
    """Group 0 by itself (one process, its own Lighthouse) resumed from the faulty run's
    checkpoint of `load_step` up to `last_step`, on the faulty run's lr schedule (STEPS long):
    the survivor's steps while the other group was away. Only that checkpoint is copied (a
    faulty run may keep many, 70 MiB each)."""
    dump = tmp_path / "alone"
    others = re.compile(r"step-\d+(-model)?")
    shutil.copytree(faulty_dump, dump, ignore=lambda folder, names: [
        name for name in names if others.fullmatch(name) and name != f"step-{load_step}"])
    port = free_port()
    lighthouse = subprocess.Popen([*lighthouse_command(), "--min_replicas", "1", "--bind", f"[::]:{port}"], env=ENV,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return run(dump, *args, *FT, "--checkpoint.load_step", str(load_step), "--checkpoint.load_only", "true",
                   "--training.steps", str(last_step), "--lr_scheduler.total_steps", str(STEPS),
                   env={**ENV, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"})
    finally:
        lighthouse.terminate()
        lighthouse.wait()


def fault_line(kill_step):
    return f"[replica 1] debug: injected fault: rank 1 crashes before step {kill_step} (debug.fault_at_step)"


def stopped_once_back(dump, *args):
    """The run's output, the run stopped by a SIGTERM to its launcher (every group at one step)
    once group 1 has recovered and trained 2 steps with group 0, or ended by itself."""
    log = dump.with_name(dump.name + ".log")
    with open(log, "w") as out:
        launcher = subprocess.Popen(command(dump, *args), env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while launcher.poll() is None and time.monotonic() < deadline:
            text = log.read_text()
            back = re.search(r"^\[replica 1\] fault tolerance: replica group 1 recovered live from replica group 0 at "
                             r"step (\d+)", text, re.M)
            if back and re.search(rf"^\[replica 1\] step +{int(back[1]) + 2}/", text, re.M):
                launcher.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        code = launcher.wait(timeout=900)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    out = log.read_text()
    assert code == 0, out[-5000:]
    return out


def killed_run(dump, kill_step, *args, stop=False):
    """The 2-group run whose group 1 is killed before `kill_step` (with `stop`, stopped once that
    group is back: stopped_once_back). Run again, once, when that group's first process did not
    train every step up to it, so the scenario did not take place: the group restarted before it
    (a start-up failure, said by its launcher's restart line; torchrun's free master port taken
    before the rank bound it was one, tessera.trainer.master_port, and the groups' checks of their
    new checkpoint folder at once another, tessera.ckpt 0.9.3), or the Lighthouse dropped it from
    a sync's quorum (no heartbeat for the tests' 1 s) and it healed, past the step or before it. The skipped run's group-1
    lines and Lighthouse log are kept beside for a reader."""
    argv = ["--nproc", "2", *args, "--debug.fault_at_step", str(kill_step), "--debug.fault_rank", "1"]
    faulty = stopped_once_back if stop else run
    out = faulty(dump, *argv)
    before, fired, _ = out.partition(fault_line(kill_step))
    if fired and "[replica 1] fault tolerance: replica group 1 recovered live" not in before:
        return out
    skipped = dump.with_name(dump.name + "-skipped")
    dump.rename(skipped)
    (skipped / "out.txt").write_text(out)
    warnings.warn(f"replica group 1 did not train every step up to {kill_step} in its first process; ran again "
                  f"(see {skipped}): " + " | ".join(line for line in out.splitlines() if line.startswith("[replica 1]")
                                                      and ("rror" in line or "recovered" in line or "from step" in line
                                                           or "launcher:" in line))[:800])
    return faulty(dump, *argv)


def check_recovery(out, kill_step, every=1):
    """The survivor (group 0) never restarted nor went back; group 1 logged its steps up to the
    kill, then from the step it recovered at; one recovery line; equal final weights (after the
    last step, or the step a stop ended both groups at). Returns (survivor's steps, group 1's, the
    recovery step)."""
    survivor, restarted = logged(out, 0), logged(out, 1)
    stops = re.findall(r"^\[replica (\d)\] stopped by .+ after step (\d+):", out, re.M)
    assert not stops or (len(stops) == 2 and stops[0][1] == stops[1][1]), stops
    last = int(stops[0][1]) if stops else STEPS
    assert [step for step, _ in survivor] == list(range(1, last + 1)), out[-6000:]
    assert fault_line(kill_step) in out, out[-6000:]
    # group 1's launcher restarted its crashed rank (which reported nothing), and said so; group 0's never did
    assert "[replica 1] launcher: the ranks failed; restarting them, restart 1 of 3" in out, out[-6000:]
    assert "[replica 0] launcher:" not in out, out[-6000:]
    recoveries = re.findall(r"^\[replica 1\] fault tolerance: replica group 1 recovered live from replica group 0 at step "
                            rf"(\d+) \(weights, optimizer, lr schedule: .*\); its data resumes after its step {kill_step - 1}$",
                            out, re.M)
    assert len(recoveries) == 1, out[-4000:]
    recovered = int(recoveries[0])
    assert kill_step <= recovered < last - every and recovered % every == 0  # the survivor trained alone meanwhile
    assert [step for step, _ in restarted] == [*range(1, kill_step), *range(recovered + 1, last + 1)]
    final = digests(out)
    assert final.keys() == {"0", "1"} and final["0"] == final["1"]
    return dict(survivor), dict(restarted), recovered


def test_a_killed_group_recovers_live_while_the_other_trains_on(tmp_path):
    # checkpoints after step 1 (the survivor resumes from it alone below) and the last; killed before step 2
    args = [*FT, "--training.steps", str(STEPS), "--checkpoint.enable", "true", "--checkpoint.enable_first_step_checkpoint",
            "true", "--checkpoint.interval", str(STEPS)]
    out = killed_run(tmp_path / "faulty", 2, *args, stop=True)
    survivor, restarted, recovered = check_recovery(out, kill_step=2)
    assert "[replica 0] fault tolerance: replica group 0: from step 2, 1 of 2 replica groups train" in out
    assert f"[replica 0] fault tolerance: replica group 0: from step {recovered + 1}, 2 of 2 replica groups train" in out
    # both groups log the mean over the groups that trained: the same numbers, before and after
    assert all(restarted[step] == survivor[step] for step in restarted)
    by_itself = dict(logged(alone(tmp_path / "faulty", tmp_path, 1, recovered + 1, *args)))
    assert all(survivor[step] == by_itself[step] for step in range(2, recovered + 1))
    assert survivor[recovered + 1] != by_itself[recovered + 1]  # the other group is back


def test_with_diloco_a_killed_group_recovers_live_at_the_next_sync(tmp_path):
    # each group checkpoints itself (the groups differ between syncs) at a sync both took part in:
    # every 24 steps, not at every sync (4), whose 37 saves per group were ~40 % of the test's CPU;
    # group 1 is killed mid-cycle after the first (killed_run reruns if a quorum dropped it before)
    interval = 24
    args = [*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4",
            "--training.steps", str(STEPS), "--checkpoint.enable", "true", "--checkpoint.interval", str(interval),
            "--checkpoint.keep_latest_k", "0"]
    out = killed_run(tmp_path / "faulty", interval + 2, *args)
    survivor, restarted, recovered = check_recovery(out, kill_step=interval + 2, every=4)
    assert survivor[1] != restarted[1]  # each group its own data and loss
    # the survivor from that checkpoint alone
    by_itself = dict(logged(alone(tmp_path / "faulty", tmp_path, interval, recovered + 5, *args)))
    # the sync the group recovers at averages the survivor's weight deltas with their copy: the
    # survivor's next inner steps are still its own; the sync after differs
    assert all(survivor[step] == by_itself[step] for step in range(interval + 1, recovered + 5))
    assert survivor[recovered + 5] != by_itself[recovered + 5]


def test_a_stop_signal_stops_every_group_at_one_step_and_the_job_resumes_exactly(tmp_path):
    # the lr schedule's horizon fixed, whatever training.steps each run is given
    args = [*FT, "--checkpoint.enable", "true", "--checkpoint.interval", "100", "--lr_scheduler.total_steps", "100"]
    dump, log = tmp_path / "stopped", tmp_path / "stopped.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(command(dump, "--nproc", "2", *args, "--training.steps", "100"), env=ENV,
                                    stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not re.search(r"^\[replica 1\] step +3/", log.read_text(), re.M):
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
    stopped = re.findall(r"^\[replica (\d)\] stopped by (SIGTERM|a stop signal to another replica group) after step (\d+)",
                         log.read_text(), re.M)
    assert len(stopped) == 2 and stopped[0][2] == stopped[1][2], stopped  # the same step
    at = int(stopped[0][2])
    assert "replica groups [0, 1] stopped by SIGTERM" in log.read_text()
    assert (dump / "checkpoint" / f"step-{at}" / ".metadata").is_file()  # written once, by group 0
    resumed = run(dump, "--nproc", "2", *args, "--training.steps", str(at + 3))
    assert f"[replica 1] checkpoint: loaded {dump / 'checkpoint' / f'step-{at}'}; training continues after step {at}" in resumed
    uninterrupted = run(tmp_path / "uninterrupted", "--nproc", "2", *args, "--training.steps", str(at + 3))
    for group in (0, 1):
        assert logged(resumed, group) == logged(uninterrupted, group)[at:]
    assert digests(resumed) == digests(uninterrupted)


def test_a_replica_group_may_be_a_pipeline(tmp_path):
    """Two groups of a 2-stage pipeline log the losses of one job of 2 data-parallel x 2 stages,
    and end with equal weights (each rank averages its stage's shards with its twin's)."""
    pipeline = ["--parallelism.pipeline_parallel_degree", "2", "--training.steps", "2"]
    groups = run(tmp_path / "groups", "--nproc", "4", *FT, *pipeline)
    job = run(tmp_path / "job", "--nproc", "4", *pipeline)
    for group in (0, 1):
        assert logged(groups, group) == logged(job)
    final = digests(groups)
    assert final.keys() == {"0", "1"} and final["0"] == final["1"]


def test_local_sgd_averages_the_groups_weights_at_every_sync(tmp_path):
    """Each group trains on its own data (its own losses); the sync at the last step averages the
    weights, so the groups end equal."""
    out = run(tmp_path / "local_sgd", "--nproc", "2", *FT, "--fault_tolerance.semi_sync_method", "local_sgd",
              "--fault_tolerance.sync_steps", "3", "--training.steps", "6")
    assert all(a != b for (_, a), (_, b) in zip(logged(out, 0), logged(out, 1)))
    final = digests(out)
    assert final.keys() == {"0", "1"} and final["0"] == final["1"]
