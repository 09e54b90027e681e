"""Build a tiny random-weights model and a byte-level BPE tokenizer, offline.

Run with the vLLM venv's Python: `python make_tiny_model.py OUT_DIR [--moe]`.
Sizes follow docs/real-vllm.md: the CPU attention backend needs a head size of
32 or more, so hidden 128 with 4 heads. --moe makes a Mixtral (4 experts, 2
per token) instead of a Llama: under data parallelism vLLM's CPU build fails
at its first request and every engine sends ENGINE_CORE_DEAD, a real fatal
error sequence for the tests.
"""

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          PreTrainedTokenizerFast)

WORDS = (
    "the quick brown fox jumps over a lazy dog while engines stream tokens to "
    "frontends through sockets and every frame is recorded replayed compared "
    "hello world one two three four five six seven eight nine ten"
).split()


def corpus():
    for i in range(4000):
        yield " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 12))


def main(out: str, moe: bool) -> None:
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tokenizer.save_pretrained(out)

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if moe:
        model = MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    main(sys.argv[1], "--moe" in sys.argv[2:])
