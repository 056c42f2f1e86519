import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bicc.config import TinyArchConfig
from bicc.model.load import build_tiny, load_pretrained, num_parameters
from bicc.model.tokenizer import build_char_tokenizer


def test_tokenizer_round_trip(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Compute 12+34-5.\n12+34=46\n\\boxed{41}"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(tok(text)["input_ids"]) == text  # one char per token, no spaces added
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert loaded.pad_token_id != loaded.eos_token_id
    chat = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_characters_map_to_unk():
    tok = build_char_tokenizer()
    assert tok("é")["input_ids"] == [tok.unk_token_id]


def test_model_round_trip(tmp_path):
    model, tok = build_tiny(TinyArchConfig(), seed=0)
    assert 0.3e6 < num_parameters(model) < 1e6
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    class ModelCfg:
        dtype, attn_implementation, gradient_checkpointing, padding_free = "float32", "sdpa", False, False

    loaded, loaded_tok = load_pretrained(str(tmp_path), ModelCfg, torch.device("cpu"))
    assert loaded.bicc_padding_free is False  # model.padding_free reaches the model bicc.kernels.packing reads
    ids = torch.tensor([tok("Compute 1+2.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), type(model))
    assert loaded_tok.padding_side == "left"


def test_build_is_seeded():
    a, _ = build_tiny(TinyArchConfig(), seed=3)
    b, _ = build_tiny(TinyArchConfig(), seed=3)
    c, _ = build_tiny(TinyArchConfig(), seed=4)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
