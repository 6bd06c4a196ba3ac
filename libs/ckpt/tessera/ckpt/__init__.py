"""Distributed checkpoints over torch.distributed.checkpoint, plus Hugging Face safetensors I/O."""

from tessera.ckpt.dcp_io import load_into, stored_keys
from tessera.ckpt.folders import export_folder, hf_export_folder
from tessera.ckpt.formats import check_state_dict, dcp_to_torch_save, read_dcp, torch_save_to_dcp, write_dcp
from tessera.ckpt.hf import export_hf, hf_tensor_names, import_hf, load_hf, quantized_weights, save_hf
from tessera.ckpt.manager import ASYNC_MODES, EXPORT_DTYPES, CheckpointManager
from tessera.ckpt.states import ModelState, OptimizerState, RankLocalState, rng_state

__all__ = [
    "ASYNC_MODES",
    "EXPORT_DTYPES",
    "CheckpointManager",
    "ModelState",
    "OptimizerState",
    "RankLocalState",
    "check_state_dict",
    "dcp_to_torch_save",
    "export_folder",
    "export_hf",
    "hf_export_folder",
    "import_hf",
    "load_hf",
    "load_into",
    "hf_tensor_names",
    "quantized_weights",
    "read_dcp",
    "rng_state",
    "save_hf",
    "stored_keys",
    "torch_save_to_dcp",
    "write_dcp",
]
