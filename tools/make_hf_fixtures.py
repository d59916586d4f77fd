"""Writes tests/fixtures/hf/: tiny random Hugging Face checkpoints and the logits transformers computes for them.

Run once, by hand, in a venv of its own: torch and transformers are never dependencies of maxshard or its CI.

    python3 -m venv /work/hfvenv && /work/hfvenv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors tokenizers
    /work/hfvenv/bin/python tools/make_hf_fixtures.py

Each fixture directory holds what `save_pretrained` writes plus `tokens.npy` (int32 [2, 12], fixed ids) and
`logits.npy` (float32 [2, 12, vocab], transformers' forward pass in float32, positions 0..11, no padding):

  llama_gqa    LlamaForCausalLM, 4 query / 2 kv heads, head_dim 8 (not hidden / heads), Llama-3 RoPE scaling with
               a short original context (all three frequency bands are used), bfloat16 weights, sharded
               (model.safetensors.index.json), plus a tiny BPE tokenizer.json; config in transformers 5.x spelling
               (`rope_parameters`).
  mistral      MistralForCausalLM, grouped-query heads, no sliding window, float32, one file.
  llama_tied   LlamaForCausalLM with tied embeddings and Llama-3 scaling, bfloat16, with config.json rewritten into
               the transformers 4.x spelling (top-level `rope_theta` + `rope_scaling`) that published checkpoints
               carry; reloading it must give the same logits, which the script checks.

  qwen3        Qwen3ForCausalLM: q/k RMSNorm per head, head_dim 16 (not hidden / heads), tied head, float32, with a
               byte-level BPE Qwen2Tokenizer that adds no BOS and a generation_config.json with two EOS ids.
  qwen3_moe    Qwen3MoeForCausalLM: 4 experts, top-2, norm_topk_prob false (the softmax's own weights), untied,
               bfloat16, same tokenizer kind.
  mixtral      MixtralForCausalLM: 4 experts, top-2 (softmax over the chosen logits), bfloat16, with a
               Llama-style tokenizer whose template adds BOS.
  deepseek_v3  DeepseekV3ForCausalLM with every feature on: multi-head latent attention with a low-rank query
               (q_lora_rank 24, kv_lora_rank 16, nope 16 + rope 8, v 16), YaRN (factor 4 over an original
               context of 8 tokens, mscale_all_dim 1, interleaved RoPE as the released config), one dense layer
               first then MoE: 8 experts in 4 groups, 2 groups kept, top-2 by sigmoid scores plus a random
               e_score_correction_bias, routed scaling 2.5, one shared expert; float32; the Llama-style tokenizer.
  deepseek_v3_mtp  deepseek_v3's shape with its multi-token-prediction layer stored as DeepSeek-V3 releases it (layer
               num_hidden_layers: enorm, hnorm, eh_proj, shared_head.norm, the layer's own tensors with experts one by
               one, copies of the embedding and head), read back by transformers' own MtpModel.from_pretrained;
               mtp_logits.npy: that module's logits for token i + 2 from the main model's normalised last hidden
               states (as transformers' use_mtp generation feeds them), no tokenizer.
  kimi_k2      deepseek_v3's shape with Kimi-K2's settings (one routing group, routed scaling 2.827, RoPE base 50000,
               YaRN with beta_fast = beta_slow = 1) and its config.json as Kimi publishes it: model_type kimi_k2,
               auto_map, topk_method noaux_tc, rope_scaling with "type"; no tokenizer.
  gemma2       Gemma2ForCausalLM: 4 layers alternating local (sliding window of 4 tokens, shorter than the 12-token
               text and than prompt + generation) and global, (1 + w) norms before and after attention and MLP,
               GeGLU (gelu_pytorch_tanh), embeddings x sqrt(width), query_pre_attn_scalar 12 (not head_dim 8),
               attention and output soft-caps small enough to bite (1.0, 4.0), tied head, float32.
  gemma3       Gemma3ForCausalLM (model_type gemma3_text): 8 layers, five local and one global then two local
               (sliding_window_pattern 6: maxshard's unit of 6 plus a last_layers stack of 2), window 4, q/k norms,
               global RoPE base 1000 with linear scaling x4, local base 50 unscaled, query_pre_attn_scalar 12,
               no soft-caps, tied head, float32.
  gemma3_mm    Gemma3ForConditionalGeneration (how Google publishes Gemma 3 4B/12B/27B) around gemma3's text
               model and weights, with a one-layer vision tower: a sparse text_config (fields at Gemma3TextConfig's
               defaults left out, as released), tensors under language_model.model.*, the tower and
               projector beside them; logits.npy is the wrapper's text-only forward (gemma3's within 1e-5, checked).

  gpt_oss      GptOssForCausalLM: 4 layers alternating sliding (window 4, shorter than the 12-token text) and full
               attention, sinks, q/k/v/o biases, 4 experts top-2 with router and expert biases, clamped SwiGLU with
               swiglu_limit 1 (so the clamp binds), YaRN with truncate false (as released), head_dim 16 != hidden
               / heads, float32, the Llama-style tokenizer (generate.json runs 16 tokens past the window).
  gpt_oss_mxfp4  the same architecture in 2 layers with its expert weights stored as the released checkpoints
               store them: MXFP4 `*_blocks` + `*_scales` (quantized here, `mxfp4_pack`) with quantization_config
               mxfp4; logits.npy is what transformers computes after its own dequantization (float32).
               Both were written with transformers 5.24.

`python tools/make_hf_fixtures.py NAME ...` rewrites only the named fixtures (all of them without names).

Every fixture with a tokenizer also gets `generate.json`: a prompt, `tokenizer(prompt)`'s ids and the tokens of
`model.generate(..., do_sample=False, max_new_tokens=16)` (stopping at the model's EOS ids). llama_gqa's
tokenizer has no template, so its prompts start without BOS.

Weights are redrawn larger than transformers' default init (std 0.15, norms 1 +- 0.1), so attention patterns and
RoPE matter for the logits; bfloat16 fixtures are rounded to bfloat16 before the reference forward pass, so the
reference is exactly the stored model.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Tokenizer
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
VOCAB = 128
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny llama reads a tiny book about sharded arrays",
    "rotary position embeddings rotate pairs of features",
    "grouped query attention shares keys and values between heads",
] * 4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def redraw(model: torch.nn.Module, seed: int, bf16: bool, norm_center: float = 1.0) -> None:
    """Random weights of a useful scale; bfloat16-representable when the fixture is stored in bfloat16. Norm scales
    are norm_center +- 0.1 (0 for Gemma's norms, which multiply by 1 + weight)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(norm_center + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
            if bf16:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))


def reference(model: torch.nn.Module, directory: pathlib.Path) -> np.ndarray:
    """Saves fixed token ids and transformers' float32 logits for them."""
    vocab = model.config.get_text_config().vocab_size  # a multimodal wrapper keeps it in its text config
    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 12)).astype(np.int32)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
    np.save(directory / "tokens.npy", tokens)
    np.save(directory / "logits.npy", logits.astype(np.float32))
    return logits


def save(model: torch.nn.Module, name: str, seed: int, bf16: bool, norm_center: float = 1.0,
         **kwargs: object) -> pathlib.Path:
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    model.eval()
    redraw(model, seed, bf16, norm_center)
    reference(model, directory)
    to_save = model.to(torch.bfloat16) if bf16 else model
    to_save.save_pretrained(directory, **kwargs)
    return directory


def tokenizer(directory: pathlib.Path) -> None:
    """A character-level BPE with <unk>, <s>, </s> and 128 ids, trained on a few sentences."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TEXTS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


PROMPT = "the lazy dog reads"
NEW_TOKENS = 16
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE as Qwen's: no BOS, <|endoftext|> ends documents and pads, no post-processor template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=QWEN_SPECIALS))
    return Qwen2Tokenizer(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                          bos_token=None, unk_token=None)


def llama_bos_tokenizer() -> PreTrainedTokenizerFast:
    """A Metaspace BPE whose template adds <s> before every text, as Llama 2 / Mistral / Mixtral tokenizers do."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def greedy(model: torch.nn.Module, tok: object, directory: pathlib.Path) -> None:
    """generate.json: what transformers' greedy generate makes of tokenizer(PROMPT)."""
    encoded = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=model.generation_config.pad_token_id)
    ids = encoded["input_ids"][0].tolist()
    new = out[0, len(ids):].tolist()
    record = {"prompt": PROMPT, "input_ids": ids, "new_tokens": new, "max_new_tokens": NEW_TOKENS}
    (directory / "generate.json").write_text(json.dumps(record) + "\n")


def fresh(directory: pathlib.Path) -> pathlib.Path:
    """An empty directory (an older fixture there removed)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def family_fixture(model: torch.nn.Module, directory: pathlib.Path) -> None:
    """A one-family fixture of a model whose weights are drawn: its reference logits, save_pretrained's files, the
    Qwen-style tokenizer, a generation config (EOS = pad = 0), a check that the saved model computes those logits,
    and 16 greedy tokens (tools/make_olmo3_fixtures.py and its siblings)."""
    reference(model, directory)
    model.save_pretrained(directory)
    tok = qwen_tokenizer()
    tok.save_pretrained(directory)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 0, 0
    model.generation_config.save_pretrained(directory)
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        again = reloaded(torch.from_numpy(np.load(directory / "tokens.npy").astype(np.int64))).logits.numpy()
    np.testing.assert_array_equal(again, np.load(directory / "logits.npy"))  # what was saved is what was run
    greedy(reloaded, tok, directory)


def run_builders(builders: dict, out: pathlib.Path, names: list[str]) -> None:
    """Runs the named builders (all when none is named), a line for each."""
    for name in names or list(builders):
        builders[name]()
        print(f"wrote {out / name}")


def with_tokenizer(model: torch.nn.Module, tok: object, directory: pathlib.Path, eos: list[int]) -> None:
    """Saves the tokenizer and a generation_config.json naming the EOS ids, then the greedy reference, computed
    from the stored (possibly bfloat16-rounded) weights in float32."""
    tok.save_pretrained(directory)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    model.generation_config = GenerationConfig(eos_token_id=eos if len(eos) > 1 else eos[0], pad_token_id=pad,
                                               bos_token_id=tok.bos_token_id)
    model.generation_config.save_pretrained(directory)
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    greedy(reloaded, tok, directory)


def to_4x_spelling(directory: pathlib.Path) -> None:
    """config.json as transformers 4.x wrote it: top-level rope_theta, rope_scaling without rope_theta."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    cfg["torch_dtype"] = cfg.pop("dtype", "bfloat16")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def deepseek_v3_config(vocab: int, **changes: object) -> DeepseekV3Config:
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    fields = dict(intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
                  qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
                  num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                  rope_parameters=yarn, rope_interleave=True, rms_norm_eps=1e-6)
    return DeepseekV3Config(**dict(COMMON, vocab_size=vocab, num_hidden_layers=2, max_position_embeddings=32),
                            **{**fields, **changes})


def correction_biases(model: torch.nn.Module, seed: int) -> None:
    """Random e_score_correction_bias buffers: a buffer, not a parameter, so `redraw` leaves it at zero, where it
    would choose nothing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))


def deepseek_v3() -> None:
    llama_tok = llama_bos_tokenizer()
    model = DeepseekV3ForCausalLM(deepseek_v3_config(len(llama_tok)))
    correction_biases(model, 70)
    with_tokenizer(model, llama_tok, save(model, "deepseek_v3", seed=7, bf16=False), [2])


# What Kimi-K2's published config.json (moonshotai/Kimi-K2-Instruct-0905, Kimi-K2-Thinking) holds beyond
# DeepSeek-V3's: its own model_type and remote-code classes, one routing group, and YaRN with beta_fast = beta_slow.
KIMI_K2_FIELDS = {
    "model_type": "kimi_k2",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "ep_size": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
    "scoring_func": "sigmoid", "seq_aux": True, "topk_method": "noaux_tc",
}


def kimi_k2() -> None:
    """DeepseekV3ForCausalLM with Kimi-K2's settings (one group of 8 experts, routed scaling 2.827, RoPE base 50000,
    YaRN with beta_fast = beta_slow = 1: a step from kept to interpolated frequencies, here over an original context
    of 8 tokens so that it shows in 12), its config.json then rewritten as Kimi publishes it (KIMI_K2_FIELDS, the
    transformers 4.x spelling); transformers has no `kimi_k2` model type, so no reload and no generate.json."""
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    model = DeepseekV3ForCausalLM(deepseek_v3_config(VOCAB, rope_parameters=yarn, n_group=1, topk_group=1,
                                                     routed_scaling_factor=2.827))
    correction_biases(model, 71)
    directory = save(model, "kimi_k2", seed=8, bf16=False)
    to_4x_spelling(directory)
    path = directory / "config.json"
    fields = json.loads(path.read_text())
    fields["rope_scaling"]["type"] = fields["rope_scaling"].pop("rope_type")  # as the released file spells it
    path.write_text(json.dumps({**fields, **KIMI_K2_FIELDS}, indent=2, sort_keys=True) + "\n")


def mtp_tensors(mtp: MtpModel, main: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """The MTP module's tensors as DeepSeek-V3 releases them: decoder layer num_hidden_layers with enorm, hnorm,
    eh_proj, shared_head.norm beside the layer's own tensors, plus copies of the embedding and head."""
    layer = f"model.layers.{main.config.num_hidden_layers}."
    out = {}
    for name, tensor in mtp.state_dict().items():
        if not name.startswith("layers.0."):
            continue
        rest = name.removeprefix("layers.0.")
        rest = "shared_head.norm." + rest.removeprefix("post_norm.") if rest.startswith("post_norm.") else \
            rest.removeprefix("mtp_block.")
        if rest == "mlp.experts.gate_up_proj":  # transformers' fused [experts, 2 x mlp, embed]: the file's are per expert
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{layer}mlp.experts.{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{layer}mlp.experts.{e}.up_proj.weight"] = up[e].clone()
        elif rest == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"{layer}mlp.experts.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[layer + rest] = tensor.clone()
    out[layer + "embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
    out[layer + "shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    return out


def deepseek_v3_mtp() -> None:
    """deepseek_v3's architecture with its multi-token-prediction layer, stored as released; mtp_logits.npy is what
    transformers' own MTP module (MtpModel, loaded from those tensors) predicts from the main model's last hidden
    states, as its use_mtp generation feeds it."""
    model = DeepseekV3ForCausalLM(deepseek_v3_config(VOCAB)).eval()
    correction_biases(model, 71)
    directory = save(model, "deepseek_v3_mtp", seed=17, bf16=False)
    mtp = MtpModel(model, 1).eval()
    gen = torch.Generator().manual_seed(18)
    with torch.no_grad():  # the module's own weights (its embedding and head are the main model's)
        for name, p in mtp.named_parameters():
            if name.startswith("layers."):
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    correction_biases(mtp, 72)
    path = directory / "model.safetensors"
    save_file({**load_file(path), **mtp_tensors(mtp, model)}, path, metadata={"format": "pt"})
    # transformers reads the released layout (MtpModel.from_pretrained), but finds the module by the 671B's layer
    # number (`_keys_to_ignore_on_load_unexpected`, model.layers.61, read when the main model loads): point it at
    # this model's
    layer = model.config.num_hidden_layers
    DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layer}.*"]
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    loaded = MtpModel.from_pretrained(reloaded).eval()
    for name, tensor in mtp.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokens = torch.from_numpy(np.load(directory / "tokens.npy").astype(np.int64))
    with torch.no_grad():
        last = reloaded(tokens, output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(1, tokens.shape[1])[None]
        hidden = loaded.forward_layer(0, last[:, :-1], positions, None, input_ids=tokens[:, 1:])
        logits = loaded._project_to_logits(hidden)
    np.save(directory / "mtp_logits.npy", logits.float().numpy())  # [batch, length - 1, vocab]: token i + 2


GEMMA = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=256, sliding_window=4, query_pre_attn_scalar=12, tie_word_embeddings=True,
             hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             attn_implementation="eager")


def gemma2() -> None:
    llama_tok = llama_bos_tokenizer()
    config = Gemma2Config(**GEMMA, vocab_size=len(llama_tok), num_hidden_layers=4, attn_logit_softcapping=1.0,
                          final_logit_softcapping=4.0, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    model = Gemma2ForCausalLM(config)
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    with_tokenizer(model, llama_tok, save(model, "gemma2", seed=14, bf16=False, norm_center=0.0), [2])


def gemma3() -> None:
    llama_tok = llama_bos_tokenizer()
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}
    config = Gemma3TextConfig(**GEMMA, vocab_size=len(llama_tok), num_hidden_layers=8, rope_parameters=rope,
                              final_logit_softcapping=None, attn_logit_softcapping=None)
    model = Gemma3ForCausalLM(config)
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    with_tokenizer(model, llama_tok, save(model, "gemma3", seed=9, bf16=False, norm_center=0.0), [2])


def gemma3_multimodal() -> None:
    """gemma3's text model inside the multimodal wrapper: the same weights, so the same text-only logits."""
    text = Gemma3ForCausalLM.from_pretrained(OUT / "gemma3", dtype=torch.float32).eval()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    # as released: text_config names no architectures and omits what equals Gemma3TextConfig's defaults
    defaults = Gemma3TextConfig().to_dict()
    text_config = {k: v for k, v in text.config.to_dict().items()
                   if k not in ("architectures", "_name_or_path") and (k == "model_type" or defaults.get(k) != v)}
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text_config, vision_config=vision,
                                                        mm_tokens_per_image=4)).eval()
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
    directory = OUT / "gemma3_mm"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    logits = reference(model, directory)
    np.testing.assert_allclose(logits, np.load(OUT / "gemma3" / "logits.npy"), rtol=0, atol=1e-5)  # same model
    model.save_pretrained(directory)
    saved = json.loads((directory / "config.json").read_text())  # transformers writes text_config in full
    (directory / "config.json").write_text(json.dumps({**saved, "text_config": text_config}, indent=2) + "\n")
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        again = reloaded(torch.from_numpy(np.load(directory / "tokens.npy").astype(np.int64))).logits.numpy()
    np.testing.assert_array_equal(again, logits)  # the sparse text_config means the same model to transformers
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(OUT / "gemma3" / name, directory / name)


def gpt_oss_config(vocab: int, layers: int) -> GptOssConfig:
    # original context 64: the ramp's ends (0 and 2.01 of 8 frequencies) are fractional, so truncate matters
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    return GptOssConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256, rope_parameters=yarn,
                        swiglu_limit=1.0, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)


def gpt_oss() -> None:
    llama_tok = llama_bos_tokenizer()
    model = GptOssForCausalLM(gpt_oss_config(len(llama_tok), 4))
    directory = save(model, "gpt_oss", seed=8, bf16=False)
    with_tokenizer(model, llama_tok, directory, [2])
    # the tokens past the window are what the test is about
    record = json.loads((directory / "generate.json").read_text())
    assert len(record["input_ids"]) + len(record["new_tokens"]) > 4 * 2


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_pack(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[experts, in, out] float -> (blocks [experts, out, in/32, 16], scales [experts, out, in/32]) uint8: blocks of
    32 inputs share a power-of-two scale (the largest magnitude maps to <= 6), each value rounded to the nearest
    e2m1 code, two codes a byte, low nibble first: the layout of the released gpt-oss checkpoints."""
    rows = np.swapaxes(weight, -1, -2)  # [experts, out, in]
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    peak = np.maximum(np.abs(groups).max(-1, keepdims=True), 1e-30)
    exponent = np.ceil(np.log2(peak / 6.0)).astype(np.int32)
    scaled = groups / np.exp2(exponent)
    code = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(-1) + 8 * (scaled < 0)
    code = code.astype(np.uint8).reshape(*groups.shape[:-1], 16, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.astype(np.uint8), (exponent[..., 0] + 127).astype(np.uint8)


def gpt_oss_mxfp4() -> None:
    """The released checkpoints' storage: expert weights as MXFP4 blocks and scales, everything else float32."""
    llama_tok = llama_bos_tokenizer()
    model = GptOssForCausalLM(gpt_oss_config(len(llama_tok), 2))
    directory = OUT / "gpt_oss_mxfp4"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    model.eval()
    redraw(model, 9, bf16=False)
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_pack(tensors.pop(name).numpy())
        tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    weight = loaded.model.layers[0].mlp.experts.gate_up_proj
    assert weight.dtype == torch.float32 and not torch.equal(weight, model.model.layers[0].mlp.experts.gate_up_proj)
    reference(loaded, directory)


def main(names: list[str]) -> None:
    if names:
        for name in names:
            {"deepseek_v3": deepseek_v3, "deepseek_v3_mtp": deepseek_v3_mtp, "kimi_k2": kimi_k2, "gemma2": gemma2, "gemma3": gemma3, "gemma3_mm": gemma3_multimodal, "gpt_oss": gpt_oss,
             "gpt_oss_mxfp4": gpt_oss_mxfp4}[name]()
        return
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=8,
                                         rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3)))
    gqa = save(llama, "llama_gqa", seed=1, bf16=True, max_shard_size="50KB")
    tokenizer(gqa)
    assert (gqa / "model.safetensors.index.json").exists(), "llama_gqa must be sharded"
    greedy(AutoModelForCausalLM.from_pretrained(gqa, dtype=torch.float32).eval(),
           PreTrainedTokenizerFast.from_pretrained(gqa), gqa)

    mistral = MistralForCausalLM(MistralConfig(**COMMON, intermediate_size=64, num_key_value_heads=2,
                                               sliding_window=None, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 1e6}))
    save(mistral, "mistral", seed=2, bf16=False)

    tied_model = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=64, num_key_value_heads=4,
                                              tie_word_embeddings=True, rope_parameters=dict(LLAMA3)))
    tied = save(tied_model, "llama_tied", seed=3, bf16=True)
    to_4x_spelling(tied)
    reloaded = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
    tokens = np.load(tied / "tokens.npy")
    with torch.no_grad():
        again = reloaded(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_array_equal(again, np.load(tied / "logits.npy"))  # the 4.x spelling means the same model

    qwen_tok = qwen_tokenizer()
    qwen_vocab = len(qwen_tok)  # the model's vocabulary is the tokenizer's: nothing generated lies outside it
    qwen_eos = [qwen_tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    qwen_common = dict(COMMON, vocab_size=qwen_vocab, bos_token_id=None, eos_token_id=qwen_eos[1])
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**qwen_common, intermediate_size=96, num_key_value_heads=2, head_dim=16,
                                         tie_word_embeddings=True, rms_norm_eps=1e-6,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    with_tokenizer(qwen3, qwen_tok, save(qwen3, "qwen3", seed=4, bf16=False), qwen_eos)

    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(**qwen_common, intermediate_size=96, moe_intermediate_size=32,
                                             num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    with_tokenizer(moe, qwen_tok, save(moe, "qwen3_moe", seed=5, bf16=True), qwen_eos)

    llama_tok = llama_bos_tokenizer()
    mixtral = MixtralForCausalLM(MixtralConfig(**dict(COMMON, vocab_size=len(llama_tok)), intermediate_size=32,
                                               num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2,
                                               sliding_window=None,
                                               rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    with_tokenizer(mixtral, llama_tok, save(mixtral, "mixtral", seed=6, bf16=True), [2])
    deepseek_v3()
    deepseek_v3_mtp()
    kimi_k2()
    gemma2()
    gemma3()
    gemma3_multimodal()
    gpt_oss()
    gpt_oss_mxfp4()

    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
