"""DeepSeek-V3's multi-token prediction against reference code written here from the report
(arXiv 2412.19437 section 2.2, with the released weights' [Emb; h] order of M_k's input): the
logits stay the main model's, and the gradients are those of L_main + lambda / D * sum_k L^k,
with and without packed documents. Its Hugging Face layout both ways: a transformers-saved
DeepseekV3 with the MTP layer's tensors added imports with them, exports them back bit for bit,
and transformers opens the export with the same logits."""

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from tessera.models import get_model_spec
from tessera.models.attention import attention_batch
from tessera.models.decoder import TransformerBlock
from tessera.models.deepseek_v3 import DeepSeekV3Args
from tessera.models.deepseek_v3.mtp import depth_tokens
from tessera.models.moe import MoEArgs

ARGS = DeepSeekV3Args(
    vocab_size=64, dim=32, n_layers=2, n_dense_layers=1, n_heads=4, inter_dim=64,
    moe=MoEArgs(n_experts=4, top_k=2, hidden_dim=16, n_shared_experts=1, score_func="sigmoid", route_norm=True),
    q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, yarn=None, max_seq_len=32,
    num_mtp_layers=2)
LAMBDA = 0.3
B, T = 2, 10


def _window():
    """t_0 .. t_T per row: inputs t_0..t_{T-1}, labels t_1..t_T."""
    return torch.randint(0, ARGS.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))


def reference_loss(model, window, document_ids=None):
    """L_main + lambda / D * sum_k L^k, position by position from the report's formulas; document
    ids (of t_0..t_{T-1}) keep each prediction within the document of its position."""
    n, depth = model.args.n_layers, model.args.num_mtp_layers
    rope = model.rope[:T]
    attention = attention_batch(model.layers, document_ids, T, "cpu")
    h = model.tok_embeddings(window[:, :T])
    for i in range(n):
        h = model.layers[str(i)](h, rope=rope, attention=attention)
    main = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), window[:, 1:].flatten())
    mtp = 0.0
    for k in range(1, depth + 1):
        module = model.layers[str(n + k - 1)]
        # h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i)]; past the window (nothing to predict) any token serves
        ahead = torch.tensor([[window[b, min(i + k, T)] for i in range(T)] for b in range(B)])
        x = module.eh_proj(torch.cat([module.enorm(model.tok_embeddings(ahead)), module.hnorm(h)], dim=-1))
        h = TransformerBlock.forward(module, x, rope=rope, attention=attention)  # TRM_k
        log_p = F.log_softmax(model.output(module.mtp_norm(h)).float(), dim=-1)
        # L^k = -1/T sum_i log P^k_i[t_{i+1+k}], over the positions whose target is in the window (and document)
        total = sum(-log_p[b, i, window[b, i + 1 + k]] for b in range(B) for i in range(T - k)
                    if document_ids is None or document_ids[b, i] == document_ids[b, i + k])
        mtp = mtp + total / (B * T)
    return main + LAMBDA / depth * mtp


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_mtp_gradients_equal_the_reference(documents):
    torch.manual_seed(0)
    model = get_model_spec("deepseek_v3").build(ARGS)
    model.mtp_scale = LAMBDA  # the trainer's set_mtp_scale, at one micro-batch per step
    reference = copy.deepcopy(model)
    window = _window()
    inputs, labels = window[:, :-1], window[:, 1:]
    # two documents per row, the second starting at a row-dependent place
    document_ids = (torch.arange(T) >= torch.tensor([[3], [6]])).long() if documents else None
    logits = model(inputs, document_ids=document_ids, labels=labels)
    torch.testing.assert_close(logits, model(inputs, document_ids=document_ids), rtol=0, atol=0)  # the main model's
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    reference_loss(reference, window, document_ids).backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert model.layers["3"].eh_proj.weight.grad.abs().sum() > 0  # the second depth trains too


def test_depth_tokens_read_the_labels_ahead():
    labels = torch.tensor([[11, 12, 13, 14, 15]])
    tokens, targets = depth_tokens(labels, 1)
    assert tokens.tolist() == [[11, 12, 13, 14, 15]] and targets.tolist() == [[12, 13, 14, 15, -100]]
    tokens, targets = depth_tokens(labels, 2, document_ids=torch.tensor([[0, 0, 1, 1, 1]]))
    assert tokens.tolist() == [[12, 13, 14, 15, 0]] and targets.tolist() == [[-100, -100, 15, -100, -100]]


def test_hf_checkpoint_with_mtp_layer_round_trips_bit_for_bit(tmp_path):
    """transformers saves no MTP layer (it drops DeepSeek's on load), so the test adds one as
    DeepSeek's checkpoints hold it: model.layers.{n}.*, with copies of the embedding and head."""
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    written = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for param in written.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    written.save_pretrained(tmp_path / "hf")
    spec = get_model_spec("deepseek_v3")
    args = spec.hf_config.args_from_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert args.num_mtp_layers == 1
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    mtp = {key: torch.randn_like(value) for key, value in spec.hf_adapter.to_hf(spec.build(args).state_dict(), args).items()
           if key.startswith("model.layers.2.")}
    mtp["model.layers.2.embed_tokens.weight"] = hf["model.embed_tokens.weight"]
    mtp["model.layers.2.shared_head.head.weight"] = hf["lm_head.weight"]
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.shared_head.norm.weight",
            "model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias"} <= set(mtp)
    hf |= {key: value.clone() for key, value in mtp.items()}
    save_file(hf, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})

    model = spec.build(args).eval()
    model.load_state_dict(spec.hf_adapter.from_hf(hf, args))  # strict: the MTP module's tensors are the file's
    back = spec.hf_adapter.to_hf(model.state_dict(), args)
    assert back.keys() == hf.keys()
    for key, value in hf.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key

    (tmp_path / "back").mkdir()
    (tmp_path / "back" / "config.json").write_text(json.dumps(spec.hf_config.config_from_args(args)))
    save_file({key: value.clone() for key, value in back.items()}, tmp_path / "back" / "model.safetensors",
              metadata={"format": "pt"})
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        want = written.eval()(tokens).logits
        torch.testing.assert_close(model(tokens), want, rtol=1e-5, atol=1e-5)
        reopened = transformers.DeepseekV3ForCausalLM.from_pretrained(
            tmp_path / "back", attn_implementation="eager", use_kernels=False).eval()
        torch.testing.assert_close(reopened(tokens).logits, want, rtol=1e-5, atol=1e-5)


def test_hf_layers_beyond_the_model_are_skipped():
    """A model without modules loads DeepSeek-V3's checkpoint as before (the MTP layer skipped)."""
    spec, args = get_model_spec("deepseek_v3"), dataclasses.replace(ARGS, num_mtp_layers=1)
    hf = spec.hf_adapter.to_hf(spec.build(args).state_dict(), args)
    plain = dataclasses.replace(args, num_mtp_layers=0)
    assert spec.hf_adapter.from_hf(hf, plain).keys() == spec.build(plain).state_dict().keys()
    assert spec.hf_adapter.stacked_slice("model.layers.2.mlp.experts.0.up_proj.weight", plain) is None
    assert spec.hf_adapter.stacked_slice("model.layers.2.mlp.experts.0.up_proj.weight", args) == ("layers.2.moe.experts.w3", 0)
