"""torchrun from the locked venv as a built program, for launching the built trainer:

    bazel build //apps/trainer //tools/launch:torchrun
    bazel-bin/tools/launch/torchrun --nproc_per_node=4 --no-python bazel-bin/apps/trainer/trainer --job.config_file ...
"""

from torch.distributed.run import main

if __name__ == "__main__":
    main()
