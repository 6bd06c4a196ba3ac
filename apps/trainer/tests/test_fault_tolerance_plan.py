"""Fault tolerance's keys (torchft, issue 30) in the job plan: torchtitan 0.2.2's [fault_tolerance]
keys are read, every mistake is one line naming the key before any worker starts, the replica
groups' data shares and layout are what the launcher starts, and the trainer needs torchft only
when fault tolerance is on."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest

from tessera.trainer import ft_plan, launch, lighthouse
from tessera.trainer.config import ConfigError, load_config
from tessera.trainer.main import main
from tessera.trainer.plan import make_plan

FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]


def plan(*argv, world_size=2):
    return make_plan(load_config(list(argv)), world_size)


def test_replica_groups_split_the_data_and_the_batch():
    job = plan(*FT, "--fault_tolerance.replica_id", "1", "--training.local_batch_size", "2")
    ft = job.fault_tolerance
    assert ft.enabled and ft.groups == 2 and ft.replica_id == 1 and ft.semi_sync is None
    assert job.dims.dp == 2 and job.batch.dp == 4 and job.batch.global_size == 8  # 2 groups x 2 dp ranks x 2
    assert ft.data_shard(1, 2) == (3, 4)  # group 1's second dp rank reads share 3 of 4
    assert ft.job_rank(1, 2) == 3  # what debug.fault_rank counts
    accumulated = plan(*FT, "--training.local_batch_size", "2", "--training.global_batch_size", "16")
    assert accumulated.batch.accumulation == 2
    off = plan()
    assert not off.fault_tolerance.enabled and off.fault_tolerance.data_shard(1, 2) == (1, 2)


def test_diloco_fragments_are_cut_like_pipeline_stages():
    ft = plan(*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments", "2",
              "--fault_tolerance.sync_steps", "4").fault_tolerance
    assert ft.semi_sync == "diloco" and ft.sync_steps == 4
    assert ft.fragments == (("tok_embeddings", "layers.0", "layers.1", "layers.2"),
                            ("layers.3", "layers.4", "layers.5", "norm", "output"))
    explicit = plan(*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.module_fqns_per_model_fragment",
                    "tok_embeddings,layers.0,layers.1;layers.2,layers.3,layers.4,layers.5,norm,output",
                    "--fault_tolerance.sync_steps", "2").fault_tolerance
    assert [len(f) for f in explicit.fragments] == [3, 6]
    assert plan(*FT, "--fault_tolerance.semi_sync_method", "local_sgd").fault_tolerance.fragments == ()


@pytest.mark.parametrize("argv, message", [
    (["--fault_tolerance.enable", "true"], "fault_tolerance.group_size must be >= 1 with fault_tolerance.enable"),
    ([*FT, "--fault_tolerance.replica_id", "2"], "fault_tolerance.replica_id 2 must be below fault_tolerance.group_size 2"),
    ([*FT, "--fault_tolerance.min_replica_size", "3"], "fault_tolerance.min_replica_size 3 exceeds fault_tolerance.group_size 2"),
    ([*FT, "--parallelism.data_parallel_replicate_degree", "2"], "parallelism.data_parallel_replicate_degree must be 1"),
    ([*FT, "--fault_tolerance.process_group", "nccl"], "fault_tolerance.process_group nccl needs CUDA"),
    (["--fault_tolerance.sync_steps", "3"], "fault_tolerance.sync_steps applies only with fault_tolerance.enable = true"),
    ([*FT, "--fault_tolerance.sync_steps", "3"], "fault_tolerance.sync_steps applies only with fault_tolerance.semi_sync_method"),
    ([*FT, "--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.num_fragments", "2"],
     "fault_tolerance.num_fragments applies only with fault_tolerance.semi_sync_method diloco"),
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments", "2",
      "--fault_tolerance.sync_steps", "3"], "fault_tolerance.sync_steps 3 must be a multiple of the 2 DiLoCo fragments"),
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4",
      "--fault_tolerance.fragment_sync_delay", "4"], "fault_tolerance.fragment_sync_delay 4 must be below"),
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.module_fqns_per_model_fragment",
      "tok_embeddings,layers.0;norm,output"], "fault_tolerance.module_fqns_per_model_fragment leaves out"),
    ([*FT, "--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.should_quantize", "true"],
     "fault_tolerance.should_quantize uses torchft's triton kernels and needs CUDA"),
    ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--parallelism.pipeline_parallel_degree", "2"],
     "fault_tolerance.semi_sync_method diloco with pipeline_parallel_degree > 1 is not supported"),
    ([*FT, "--fault_tolerance.semi_sync_method", "adam"], "config key fault_tolerance.semi_sync_method: 'adam' is not one of"),
])
def test_every_mistake_is_one_line_naming_the_key(argv, message):
    with pytest.raises(ConfigError) as error:
        plan(*argv)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_the_launcher_refuses_ranks_that_do_not_split_into_groups(capsys):
    assert main(["--nproc", "3", *FT]) == 2
    assert capsys.readouterr().err.strip() == "error: 3 ranks do not split into fault_tolerance.group_size 2 replica groups"


def test_groups_of_each_node():
    config = load_config([*FT])
    # one node, 4 ranks: two groups of 2, standalone
    assert launch.groups_of_node(4, ["localhost"], 0, config) == [(0, 2, ["localhost"], 0), (1, 2, ["localhost"], 0)]
    # two nodes of 2 ranks: a group per node
    assert launch.groups_of_node(2, ["a", "b"], 1, config) == [(1, 2, ["b"], 0)]
    # four nodes: each group two whole nodes, rendezvous on its first
    assert launch.groups_of_node(2, ["a", "b", "c", "d"], 3, config) == [(1, 2, ["c", "d"], 1)]
    with pytest.raises(ConfigError, match="replica groups of 3 ranks are not whole nodes of 2 ranks"):
        launch.groups_of_node(2, ["a", "b", "c"], 0, config)
    assert launch.rendezvous(["a"], 29500, "job") == ["--standalone"]
    assert launch.rendezvous(["a", "b"], 29500, "job")[:3] == ["--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=a:29500"]


def test_without_torchft_fault_tolerance_says_what_to_install(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a))
    assert main(["--nproc", "2", *FT]) == 2
    assert capsys.readouterr().err.strip() == ("error: fault_tolerance.enable needs torchft, which is not installed: "
                                               f"pip install {ft_plan.TORCHFT_PIN}")
    notes = make_plan(load_config(FT), 2, check_only=True).notes  # planning for another host: a note
    assert f"fault_tolerance.enable needs torchft, which is not installed: pip install {ft_plan.TORCHFT_PIN}" in notes


def test_a_plain_run_imports_neither_torchft_nor_torch_pipelining(tmp_path):
    code = ("import sys; sys.modules['torchft'] = None\n"  # any import of torchft now fails
            "sys.modules['torch.distributed.pipelining'] = None\n"  # nor pipelining's, without pp (dynamo: ~1 s a process)
            "from tessera.trainer.config import load_config\nfrom tessera.trainer.train import train\n"
            f"train(load_config(['--training.steps', '1', '--training.seq_len', '32', '--training.local_batch_size', '2', "
            f"'--job.dump_folder', {str(tmp_path)!r}]))\nprint('trained')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": ":".join(sys.path), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0 and result.stdout.strip().endswith("trained"), result.stderr[-2000:]


def test_the_lighthouse_starts_without_torch(tmp_path):
    """The launcher's Lighthouse is the wheel's extension alone: with a torch that fails to import
    first on the path (torchft's own script imports torch, and exits), it still serves."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('the Lighthouse imported torch')\n")
    log = tmp_path / "lighthouse.log"
    with open(log, "w") as out:
        server = subprocess.Popen([*lighthouse.command(), "--min_replicas", "1", "--bind", "[::]:0"], stdout=out,
                                  stderr=subprocess.STDOUT, env={"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    try:
        deadline = time.monotonic() + 60
        while "Lighthouse listening on" not in log.read_text() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.poll() is None and "Lighthouse listening on" in log.read_text(), log.read_text()
    finally:
        server.kill()
        server.wait()
