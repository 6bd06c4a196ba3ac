"""torchrun from the locked venv as a built program, for launching the built trainer:

    bazel build //apps/trainer //tools/launch:torchrun
    bazel-bin/tools/launch/torchrun --nproc_per_node=4 --no-python bazel-bin/apps/trainer/trainer --job.config_file ...

With `--max-restarts N` a failed rank restarts the job, which resumes from its newest checkpoint.
For that to work, each attempt's ranks meet in a rendezvous store of their own: torchrun's
default shares one store across attempts, where a restarted rank reads the failed attempt's
addresses and cannot connect (pytorch#135712), so this launcher turns the sharing off, and
holds each attempt's master port until rank 0 binds it (tessera/trainer/master_port.py).
"""

import os

from torch.distributed.run import main

from tessera.trainer.master_port import hold_master_ports

if __name__ == "__main__":
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    hold_master_ports()
    main()
