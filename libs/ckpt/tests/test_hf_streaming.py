"""import_hf / export_hf on 2 FSDP ranks: the same weights and files as the full-state-dict
paths they replace, while a rank reads each tensor once and holds one full tensor at a time."""

import collections
import io
import json
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import tessera.ckpt.hf
from tessera.ckpt import export_hf, import_hf, load_hf, save_hf
from tessera.mesh.testing import run_on_ranks

VOCAB, DIM = 11, 6  # 11 rows over 2 ranks: uneven shards


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()


class Toy(nn.Module):
    """Llama's names (tok_embeddings, layers.<i>, norm, output), optionally tied embeddings."""

    def __init__(self, tied=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()  # norms too: nothing equal by chance


_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attention_norm.weight": "input_layernorm.weight", "attention.wq.weight": "self_attn.q_proj.weight",
          "attention.wo.weight": "self_attn.o_proj.weight"}


def to_hf(state_dict, tied=False):
    """Like the Llama adapter: per key, wq changed as a whole (transposed here), tied lm_head left out."""
    out = {}
    for key, value in state_dict.items():
        if key in _TOP:
            if not (tied and key == "output.weight"):
                out[_TOP[key]] = value
            continue
        _, layer, name = key.split(".", 2)
        out[f"model.layers.{layer}.{_LAYER[name]}"] = value.t() if name == "attention.wq.weight" else value
    return out


def from_hf(state_dict, tied=False):
    top, per_layer = {v: k for k, v in _TOP.items()}, {v: k for k, v in _LAYER.items()}
    out = {}
    for key, value in state_dict.items():
        if key in top:
            out[top[key]] = value
            continue
        _, _, layer, hf_name = key.split(".", 3)
        name = per_layer[hf_name]
        out[f"layers.{layer}.{name}"] = value.t() if name == "attention.wq.weight" else value
    if tied and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def _fsdp(model, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_toy(world_size, seed, tied=False):
    torch.manual_seed(seed)
    return _fsdp(Toy(tied), world_size)


def _full(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _packed(*values):
    """Results leave a worker as bytes (see test_fsdp_reshard)."""
    buffer = io.BytesIO()
    torch.save(values, buffer)
    return buffer.getvalue()


def _unpacked(data):
    return torch.load(io.BytesIO(data), weights_only=True)


def _assert_equal(expected, actual):
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert value.dtype == actual[key].dtype and torch.equal(value, actual[key]), key


def _hf_folder(folder, tied, max_shard_bytes=5 * 10**9):
    """A Hugging Face folder of a seed-0 Toy, and its weights."""
    torch.manual_seed(0)
    weights = Toy(tied).state_dict()
    save_hf(to_hf(weights, tied), folder, max_shard_bytes=max_shard_bytes)
    return weights


def _import_both_ways(rank, world_size, cases):
    results = []
    for folder, tied in cases:
        streamed = _fsdp_toy(world_size, seed=1, tied=tied)
        import_hf(streamed, folder, lambda sd: from_hf(sd, tied))
        reference = _fsdp_toy(world_size, seed=1, tied=tied)
        full = from_hf(load_hf(folder), tied)
        set_model_state_dict(reference, full, options=StateDictOptions(full_state_dict=True))
        results.append((_full(streamed), _full(reference), streamed.output.weight is streamed.tok_embeddings.weight))
    return _packed(results)


def test_streamed_import_equals_the_full_state_dict_import(tmp_path):
    cases = [(tmp_path / "untied", False), (tmp_path / "tied", True)]
    originals = [_hf_folder(folder, tied, max_shard_bytes=300) for folder, tied in cases]
    for result in run_on_ranks(_import_both_ways, 2, cases):
        for (streamed, reference, still_tied), original, (_, tied) in zip(_unpacked(result)[0], originals, cases):
            _assert_equal(reference, streamed)
            _assert_equal(original, streamed)
            assert still_tied == tied


EXPORTS = {"single": (torch.bfloat16, 5 * 10**9), "sharded": (torch.float32, 300)}


def _export_both_ways(rank, world_size, out):
    model = _fsdp_toy(world_size, seed=0)
    for name, (dtype, max_shard_bytes) in EXPORTS.items():
        assert export_hf(model, out / name, to_hf, dtype=dtype, max_shard_bytes=max_shard_bytes)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:  # what the trainer did before: gather everything, convert, cast, save
            save_hf({k: v.to(dtype) for k, v in to_hf(full).items()}, out / f"{name}-gathered", max_shard_bytes=max_shard_bytes)
    again = export_hf(model, out / "single", to_hf)
    reloaded = _fsdp_toy(world_size, seed=1)
    import_hf(reloaded, out / "sharded", from_hf)
    return _packed(again, _full(model), _full(reloaded))


def test_streamed_export_writes_the_full_gather_files_and_round_trips(tmp_path):
    results = [_unpacked(r) for r in run_on_ranks(_export_both_ways, 2, tmp_path)]
    for name in EXPORTS:
        files = sorted(p.name for p in (tmp_path / name).iterdir())
        assert files == sorted(p.name for p in (tmp_path / f"{name}-gathered").iterdir())
        for file in files:
            assert (tmp_path / name / file).read_bytes() == (tmp_path / f"{name}-gathered" / file).read_bytes(), file
    assert len(files) > 3 and "model.safetensors.index.json" in files  # "sharded": several files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharded", "sharded-gathered", "single", "single-gathered"]  # no tmp left
    for again, weights, reloaded in results:
        assert again is False  # the folder exists: nothing written
        _assert_equal(weights, reloaded)


class _Alive:
    """Registered tensors still alive now, the most alive at once, and reads per name."""

    def __init__(self):
        self.now = self.peak = 0
        self.reads = collections.Counter()

    def add(self, tensor):
        self.now += 1
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._freed)
        return tensor

    def _freed(self):
        self.now -= 1


class _CountingFile:
    """A safe_open handle whose reads are registered with an _Alive."""

    def __init__(self, handle, alive):
        self.handle, self.alive = handle, alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name):
        return self.handle.get_slice(name)

    def get_tensor(self, name):
        self.alive.reads[name] += 1
        return self.alive.add(self.handle.get_tensor(name))


_SAFE_OPEN = tessera.ckpt.hf.safe_open


def _counting_reads():
    """Counts reads from now on (replacing the previous counter) in this worker process."""
    alive = _Alive()
    tessera.ckpt.hf.safe_open = lambda path, framework: _CountingFile(_SAFE_OPEN(path, framework=framework), alive)
    return alive


def _counting_gathers():
    """Counts full tensors gathered from DTensors from now on, in this worker process."""
    alive, real = _Alive(), DTensor.full_tensor
    DTensor.full_tensor = lambda self, **kwargs: alive.add(real(self, **kwargs))
    return alive


def _measure(rank, world_size, folder, out):
    """Import into the whole model and into a pipeline stage without layer 1, then export."""
    model_shapes = {key: tuple(value.shape) for key, value in Toy().state_dict().items()}
    reads = _counting_reads()
    model = _fsdp_toy(world_size, seed=1)
    import_hf(model, folder, from_hf)
    stage_reads = _counting_reads()
    torch.manual_seed(1)
    stage = Toy()
    del stage.layers["1"]
    import_hf(_fsdp(stage, world_size), folder, from_hf, model_shapes=model_shapes)
    gathers = _counting_gathers()
    export_hf(model, out, to_hf, max_shard_bytes=300)
    return _packed(dict(reads.reads), reads.peak, dict(stage_reads.reads), stage_reads.peak, _full(stage), gathers.peak)


def test_a_rank_reads_each_tensor_once_and_holds_one_full_tensor(tmp_path):
    weights = _hf_folder(tmp_path / "hf", tied=False, max_shard_bytes=300)
    hf_names = set(to_hf(weights))
    results = [_unpacked(r) for r in run_on_ranks(_measure, 2, tmp_path / "hf", tmp_path / "out")]
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    most_per_file = max(collections.Counter(weight_map.values()).values())
    assert weight_map.keys() == hf_names and 1 < most_per_file < len(hf_names)
    for rank, (reads, peak, stage_reads, stage_peak, stage, gather_peak) in enumerate(results):
        assert set(reads) == hf_names and set(reads.values()) == {1} and peak == 1
        assert set(stage_reads) == {n for n in hf_names if not n.startswith("model.layers.1.")}  # layer 1 never read
        assert set(stage_reads.values()) == {1} and stage_peak == 1
        _assert_equal({k: v for k, v in weights.items() if not k.startswith("layers.1.")}, stage)
        # full tensors alive at once while exporting: one file's worth on rank 0, one elsewhere
        assert gather_peak == (most_per_file if rank == 0 else 1)


def _failing_export(rank, world_size, out):
    """Rank 0's second file cannot be written (disk full)."""
    if rank == 0:
        real, calls = tessera.ckpt.hf.save_file, []

        def save_file(*args, **kwargs):
            calls.append(args)
            if len(calls) == 2:
                raise OSError("disk full")
            real(*args, **kwargs)

        tessera.ckpt.hf.save_file = save_file
    try:
        export_hf(_fsdp_toy(world_size, seed=0), out, to_hf, max_shard_bytes=300)
    except OSError as e:
        return str(e)
    return None


def test_a_failed_write_raises_on_rank_0_without_hanging_the_others(tmp_path):
    out = tmp_path / "out"
    assert run_on_ranks(_failing_export, 2, out, timeout_s=120) == [f"cannot write Hugging Face export {out}: disk full", None]
    assert list(tmp_path.iterdir()) == []  # neither the export nor its tmp folder


def test_import_checks_names_and_shapes_before_reading(tmp_path):
    weights = _hf_folder(tmp_path / "hf", tied=False)

    def renamed(state_dict):
        return {"final_norm.weight" if k == "norm.weight" else k: v for k, v in from_hf(state_dict).items()}

    narrow = {key: (1,) if key == "norm.weight" else tuple(value.shape) for key, value in weights.items()}
    cases = [
        (renamed, None, "Hugging Face checkpoint .*/hf lacks 'norm.weight', which the model has"),
        (lambda sd: from_hf(sd, tied=True), None, "'(lm_head|model.embed_tokens).weight' and '.*' both convert to 'output.weight'"),
        (from_hf, narrow, r"'norm.weight' has shape \(6,\) but the model needs \(1,\)"),
    ]
    reads = _counting_reads()
    try:
        for convert, model_shapes, error in cases:
            with pytest.raises(ValueError, match=error):
                import_hf(Toy(), tmp_path / "hf", convert, model_shapes=model_shapes)
    finally:
        tessera.ckpt.hf.safe_open = _SAFE_OPEN
    assert not reads.reads  # refused before reading any data


class Stacked(nn.Module):
    """Tensors stacked on dim 0 from one HF tensor per slice (MoE experts), and a plain one."""

    def __init__(self):
        super().__init__()
        self.rows = nn.Parameter(torch.randn(5, 3, 4))  # 5 slices over 2 ranks: 3 and 2
        self.cols = nn.Parameter(torch.randn(2, 4, 3))
        self.gate = nn.Parameter(torch.randn(4, 4))


def _stacked_slice(name):
    """"experts.<i>.<key>" is slice i of <key>."""
    parts = name.split(".")
    return (parts[2], int(parts[1])) if parts[0] == "experts" else None


def _stacked_folder(folder):
    torch.manual_seed(0)
    weights = Stacked().state_dict()
    hf = {f"experts.{i}.{key}": weights[key][i] for key in ("rows", "cols") for i in range(len(weights[key]))}
    save_hf({**hf, "gate": weights["gate"]}, folder, max_shard_bytes=100)
    return weights


def _import_stacked(rank, world_size, folder):
    """Into rows sharded on dim 0 (expert parallel) and cols on dim 1 (FSDP over too few experts)."""
    torch.manual_seed(1)
    model, mesh = Stacked(), init_device_mesh("cpu", (world_size,))
    for name, dim in (("rows", 0), ("cols", 1)):
        setattr(model, name, nn.Parameter(distribute_tensor(getattr(model, name).detach(), mesh, [Shard(dim)])))
    reads = _counting_reads()
    import_hf(model, folder, lambda sd: sd, stacked=_stacked_slice)
    tessera.ckpt.hf.safe_open = _SAFE_OPEN
    return _packed(_full(model), dict(reads.reads), reads.peak)


def test_stacked_slices_are_read_by_the_ranks_holding_them(tmp_path):
    weights = _stacked_folder(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    results = [_unpacked(r) for r in run_on_ranks(_import_stacked, 2, tmp_path / "hf")]
    cols = {"experts.0.cols", "experts.1.cols", "gate"}
    for (state, reads, peak), rows in zip(results, ([0, 1, 2], [3, 4])):
        _assert_equal(weights, state)
        assert set(reads) == {f"experts.{i}.rows" for i in rows} | cols and set(reads.values()) == {1} and peak == 1
    plain = Stacked()
    import_hf(plain, tmp_path / "hf", lambda sd: sd, stacked=_stacked_slice)
    _assert_equal(weights, plain.state_dict())


@pytest.mark.parametrize("changes, error", [
    ({"experts.4.rows": None}, r"'rows' has shape \(4, 3, 4\) but the model needs \(5, 3, 4\)"),
    ({"experts.2.rows": None}, r"'rows' is stacked from slices \[0, 1, 3, 4\], not 0..3"),
    ({"experts.1.cols": torch.zeros(4, 2)}, r"the slices of 'cols' differ in shape: \[\(4, 2\), \(4, 3\)\]"),
])
def test_bad_stacks_are_named_before_reading(tmp_path, changes, error):
    folder = tmp_path / "hf"
    _stacked_folder(folder)
    kept = {k: v for k, v in load_hf(folder).items() if changes.get(k, 0) is not None}
    save_hf({**kept, **{k: v for k, v in changes.items() if v is not None}}, tmp_path / "bad")
    reads = _counting_reads()
    try:
        with pytest.raises(ValueError, match=error):
            import_hf(Stacked(), tmp_path / "bad", lambda sd: sd, stacked=_stacked_slice)
    finally:
        tessera.ckpt.hf.safe_open = _SAFE_OPEN
    assert not reads.reads


class Quantised(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, 4))
        self.b = nn.Parameter(torch.zeros(2))


def _dequantising(state_dict):
    """An adapter that makes "w" of its blocks and scales (MXFP4's companions), which it needs in one call."""
    if "w_blocks" not in state_dict and "w_scales" not in state_dict:
        return dict(state_dict)
    assert state_dict.keys() == {"w_blocks", "w_scales"}, state_dict.keys()
    return {"w": state_dict["w_blocks"].float() * state_dict["w_scales"].float()[:, None]}


def test_a_quantised_weights_companions_are_converted_together(tmp_path):
    """Even from two shard files: each tensor is read once, the pair handed over in one call."""
    blocks, scales = torch.randint(0, 255, (3, 4), dtype=torch.uint8), torch.tensor([1, 2, 4], dtype=torch.uint8)
    bias = torch.randn(2)
    save_hf({"w_blocks": blocks, "b": bias, "w_scales": scales}, tmp_path / "hf", max_shard_bytes=12)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["w_blocks"] != index["w_scales"]
    model = Quantised()
    reads = _counting_reads()
    try:
        import_hf(model, tmp_path / "hf", _dequantising)
    finally:
        tessera.ckpt.hf.safe_open = _SAFE_OPEN
    assert torch.equal(model.w.detach(), blocks.float() * scales.float()[:, None])
    assert torch.equal(model.b.detach(), bias)
    assert dict(reads.reads) == {"w_blocks": 1, "w_scales": 1, "b": 1}
