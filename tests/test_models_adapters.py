"""The built-in model, loading errors, adapter invariants and the save check."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from zerolab import adapters
from zerolab.config import AdapterSpec, ModelSpec
from zerolab.models import ModelLoadError, linear_module_names, load_model, load_tokenizer


def test_tiny_model_is_a_qwen2_with_chatml(tiny_model_path):
    tok = load_tokenizer(ModelSpec())
    model = load_model(ModelSpec(), torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "5="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n5=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= linear_module_names(ModelSpec())


def test_missing_folder_and_offline_hub_id_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="there is no folder './no/such/model'"):
        load_tokenizer(ModelSpec(name_or_path="./no/such/model"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="looked up as a Hugging Face hub id; if this machine has no network"):
        load_tokenizer(ModelSpec(name_or_path="someorg/not-a-real-model"))


@pytest.mark.parametrize("method", ["lora", "dora", "rslora"])
def test_only_adapter_weights_train_and_their_count_is_the_closed_form(tiny_model_path, method):
    model = load_model(ModelSpec(), torch.float32)
    spec = AdapterSpec(method=method, r=4)
    peft_model = adapters.apply_adapter(model, spec, total_steps=10)
    trainable_names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable_names and all("lora_" in n for n in trainable_names)
    trainable, total = adapters.parameter_counts(peft_model)
    assert trainable == adapters.lora_trainable_closed_form(model.config, spec)
    assert total > trainable


def test_adalora_starts_at_init_rank(tiny_model_path):
    model = load_model(ModelSpec(), torch.float32)
    peft_model = adapters.apply_adapter(model, AdapterSpec(method="adalora", r=4, adalora_init_r=8), total_steps=100)
    lora_e = [p for n, p in peft_model.named_parameters() if "lora_E" in n]
    assert lora_e and all(p.shape[0] == 8 for p in lora_e)
    assert peft_model.peft_config["default"].total_step == 100


def test_full_fine_tuning_trains_everything(tiny_model_path):
    model = adapters.apply_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(method="full"), total_steps=1)
    trainable, total = adapters.parameter_counts(model)
    assert trainable == total


def test_save_check_catches_empty_missing_and_misshaped_tensors(tmp_path):
    expected = {"a.lora_A.weight": (4, 8), "a.lora_B.weight": (8, 4)}
    save_file({"a.lora_A.weight": torch.ones(4, 8), "a.lora_B.weight": torch.ones(8, 4)}, str(tmp_path / "adapter_model.safetensors"))
    assert adapters.verify_saved(tmp_path, expected) == 2
    save_file({"a.lora_A.weight": torch.ones(0), "a.lora_B.weight": torch.ones(8, 4)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(adapters.SaveCheckError, match="is empty"):
        adapters.verify_saved(tmp_path, expected)
    save_file({"a.lora_A.weight": torch.ones(4, 7)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(adapters.SaveCheckError, match="missing .*a.lora_B.weight.*wrong shape"):
        adapters.verify_saved(tmp_path, expected)


def test_saved_adapter_round_trips_through_peft(tiny_model_path, tmp_path):
    from peft import PeftModel

    tok = load_tokenizer(ModelSpec())
    model = adapters.apply_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(r=4), total_steps=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters.save_trained(model, state, tmp_path / "adapter", tok) == len(state)
    reloaded = PeftModel.from_pretrained(load_model(ModelSpec(), torch.float32), str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[1, 5, 9, 20, 33]])
    with torch.no_grad():
        assert torch.allclose(model.eval()(ids).logits, reloaded(ids).logits, atol=1e-5)
