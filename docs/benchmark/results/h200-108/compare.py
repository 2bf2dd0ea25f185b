"""Fold against the pre-fold LoRA nodes on CUDA at 7B shapes: a 2-layer Qwen2.5-7B-shaped model (vocab
4096), LoRA r16 alpha 32 on all linear layers, Liger kernels, gradient checkpointing; one 4k row.
(1) one forward/backward in bf16 for each path against the fp32 peft computation; (2) 12 AdamW steps each."""
import sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from zerolab import lora_nodes, kernels
from zerolab.adapters import apply_adapter
from zerolab.config import AdapterSpec

def build(dtype, fuse, fold=True, liger=True):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4,
                      vocab_size=4096, max_position_embeddings=8192)
    model = Qwen2ForCausalLM(cfg).to("cuda", dtype)
    if liger:
        kernels.apply_liger(model, fused_loss=False, layers=True)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}); model.enable_input_require_grads()
    model = apply_adapter(model, AdapterSpec(method="lora", r=16, alpha=32, dropout=0.0), 10).to("cuda", dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n: p.normal_(std=0.02)
    if fuse:
        lora_nodes.fuse_lora(model); lora_nodes.fuse_shared_inputs(model); lora_nodes.fuse_swiglu_down(model)
    model.train()
    return model

orig = lora_nodes._Fold.of
def set_fold(on):
    lora_nodes._Fold.of = orig if on else classmethod(lambda cls, layers: None)

ids = torch.randint(0, 4096, (1, 4096), generator=torch.Generator().manual_seed(1)).cuda()
def grads(model):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}

ref_loss, ref = grads(build(torch.float32, False, liger=False))
for name, fold, liger in (("fold", True, True), ("old", False, True), ("fold no-liger", True, False), ("old no-liger", False, False)):
    set_fold(fold)
    loss, g = grads(build(torch.bfloat16, True, liger=liger))
    errs = sorted(((g[n] - ref[n]).norm().item() / max(ref[n].norm().item(), 1e-12), n) for n in ref)
    print(f"{name}: loss {loss:.5f} (fp32 {ref_loss:.5f}); grad rel err median {errs[len(errs)//2][0]:.4f} max {errs[-1][0]:.4f} ({errs[-1][1]})", flush=True)
    torch.cuda.empty_cache()
for name, fold in (("fold", True), ("old", False)):
    set_fold(fold)
    model = build(torch.bfloat16, True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    losses = []
    for step in range(12):
        loss = model(input_ids=ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad(); losses.append(round(loss.item(), 4))
    print(name, losses, flush=True)
    del model, opt; torch.cuda.empty_cache()
