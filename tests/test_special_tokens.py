"""<|mask|> addition and the filler / end-of-turn choice (docs/design.md sections 2 and 5)."""

import pytest
import torch

from data.toy_tokenizer import build_char_tokenizer
from tests.tiny import tiny_model
from train.special_tokens import MASK_TOKEN, add_mask_token, end_of_turn_id, filler_id


@pytest.mark.parametrize("tied", [True, False])
def test_mask_rows_are_the_mean_of_real_rows(tied):
    tok = build_char_tokenizer()
    n = len(tok)
    model = tiny_model("qwen3", tied=tied, vocab=n)
    before_in = model.get_input_embeddings().weight[:n].clone()
    before_out = model.get_output_embeddings().weight[:n].clone()
    mask_id = add_mask_token(model, tok)
    assert mask_id == n and tok.convert_tokens_to_ids(MASK_TOKEN) == n and len(tok) == n + 1
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    assert emb.shape[0] == n + 1 and model.config.vocab_size == n + 1
    torch.testing.assert_close(emb[:n], before_in)
    torch.testing.assert_close(emb[mask_id], before_in.mean(0))
    torch.testing.assert_close(out[mask_id], before_out.mean(0))
    assert (out.data_ptr() == emb.data_ptr()) == tied
    assert add_mask_token(model, tok) == mask_id, "adding twice is a no-op"
    # The tokenizer keeps <|mask|> whole.
    assert tok("a<|mask|>b", add_special_tokens=False)["input_ids"][1] == mask_id


def test_padding_rows_are_reused_never_shrunk():
    tok = build_char_tokenizer()
    n = len(tok)
    model = tiny_model("qwen3", tied=False, vocab=n + 28)  # vocab padded past the tokenizer
    mask_id = add_mask_token(model, tok)
    assert mask_id == n
    assert model.get_input_embeddings().weight.shape[0] == n + 28
    real = model.get_input_embeddings().weight[:n]
    torch.testing.assert_close(model.get_input_embeddings().weight[mask_id], real.mean(0))


def test_end_of_turn_and_filler_with_pad_equal_to_end_of_turn():
    tok = build_char_tokenizer()
    assert tok.pad_token_id == tok.eos_token_id  # like many real chat tokenizers
    eot = end_of_turn_id(tok)
    assert tok.convert_ids_to_tokens(eot) == "<|im_end|>"
    fill = filler_id(tok, eot)
    assert fill != eot and tok.convert_ids_to_tokens(fill) == "<|endoftext|>"


def test_no_filler_is_a_clear_error():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={"<eot>": 0, "a": 1}, unk_token="a"))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eot>", pad_token="<eot>")
    with pytest.raises(ValueError, match="no filler token"):
        filler_id(tok, end_of_turn_id(tok))
