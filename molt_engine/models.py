"""Policies: built-in presets (random init from transformers config classes) with an offline char tokenizer, or a local HF directory."""
import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

# Architectures only; sizes are chosen so that a CPU learns the built-in envs in minutes.
PRESETS = {
    "tiny-dense": lambda vocab: LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=None),
}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character: built in code, so it is identical on every machine and needs no hub."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # Oniguruma (?m) = dot-all
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def load_policy(model_cfg, seed: int):
    """(model, tokenizer) in fp32 train mode: a preset built from seed, or `model_cfg.path` loaded offline."""
    if model_cfg.path:
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, local_files_only=True, dtype=torch.float32)
    else:
        tokenizer = char_tokenizer()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(PRESETS[model_cfg.preset](len(tokenizer)), dtype=torch.float32)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.train(), tokenizer
